"""Each vLLM engine's share of the device, checked before anything is loaded."""

from __future__ import annotations

from dataclasses import replace

from kvrescue.cost import Architecture
from kvrescue.devices import is_gpu
from kvrescue.errors import InputError
from kvrescue.model_config import ModelConfigError
from kvrescue.vllm_engine.roles import EngineSpec


def engine_shares(specs: list[EngineSpec], fraction: float, dtype_bytes: int, device: str, free: int,
                  total: int) -> list[dict]:
    """Each engine's share as `start_llm` takes it (`specs` order), after one-line errors for a share that does not
    fit: vLLM gets `fraction` (--vllm-memory) of the device (of RAM on a CPU, where it must be available), split
    evenly between its engines, each of which must hold its weights and one whole context's KV. On a CPU an
    engine's KV cache is given in bytes (vLLM's share of RAM there counts its whole process)."""
    share = fraction * total
    each, shares = share / len(specs), []
    for spec in specs:
        try:
            arch = replace(Architecture.of_model(spec.model), dtype_bytes=dtype_bytes)
        except ModelConfigError as err:
            raise InputError(f"{'/'.join(spec.roles)} model {spec.model}: no usable config.json for vLLM ({err})") from None
        need = arch.params * dtype_bytes + arch.kv_bytes_per_token * spec.max_model_len
        if need > each:
            raise InputError(f"--vllm-memory {fraction}: vLLM's {share / 2**30:.2f} GiB of {device} over its "
                             f"{len(specs)} engine(s) leaves {each / 2**30:.2f} GiB for the {'/'.join(spec.roles)} "
                             f"model, whose weights and one {spec.max_model_len}-token context need "
                             f"{need / 2**30:.2f} GiB; raise --vllm-memory")
        shares.append({"memory": each / total} if is_gpu(device)
                      else {"kv_cache_bytes": int(each - arch.params * dtype_bytes)})
    if not is_gpu(device) and share > free:
        raise InputError(f"--vllm-memory {fraction}: {share / 2**30:.1f} GiB of RAM for vLLM, but "
                         f"{free / 2**30:.1f} GiB is available; lower --vllm-memory")
    return shares
