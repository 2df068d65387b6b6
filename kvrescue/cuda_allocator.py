"""PyTorch's CUDA caching allocator, set up for long runs of mixed shapes before a run's first CUDA allocation.

A run allocates caches, activations and sampling buffers whose sizes change with every batch and step; with the
allocator's default fixed-size segments the freed blocks fragment, and what PyTorch reserves grows well past what is
allocated (issue 41: 91.1 GiB reserved for 81.7 GiB allocated). Expandable segments map more memory into one
segment as it grows, so reserved stays close to allocated; vLLM and SGLang run with them on. A user's own
PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF is kept as it is.
"""

from __future__ import annotations

import os

VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the first is the newer name; PyTorch reads either
SETTINGS = "expandable_segments:True"


def allocator_settings() -> str:
    """The allocator's settings for a GPU run: the user's variable where one is set, else SETTINGS (no torch import:
    config.json's environment records it)."""
    return next((os.environ[v] for v in VARIABLES if os.environ.get(v)), SETTINGS)


def configure_allocator() -> None:
    """SETTINGS for this process's allocator and the processes it starts (a `--tp` group's ranks), unless the user
    set one: through the environment, which the allocator reads at its first allocation, and through PyTorch's
    setter, which also applies where the allocator has already started."""
    if any(os.environ.get(v) for v in VARIABLES):
        return
    import torch

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # PyTorch >= 2.9; before, torch.cuda's
    (setter or torch.cuda.memory._set_allocator_settings)(SETTINGS)
