"""Attention kernels returning, on the CPU, the memory layouts CUDA's kernels return: same values, other strides.

CPU kernels return contiguous outputs, CUDA's do not, so code that assumes a kernel's output strides (a `view`)
passes on the CPU and fails at its first CUDA forward. Through these wrappers the CPU suite sees CUDA's layouts:

- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` whose output [B, H, M, D] lies in memory as
  [B, M, H, D], as CUDA's memory-efficient kernel (the one serving masks) allocates it (PyTorch attention.cu:
  `res = at::empty({B, M, num_heads, Kv})`, returned `transpose(1, 2)`).
- `flash_kvcache(kernel)`: a `flash_attn_with_kvcache` stand-in whose `out` is allocated as flash-attn's
  mha_fwd_kvcache does (`empty_like(q)`: q's strides where q is dense, else dense ones in the order of q's; with
  one query per row and grouped heads, those of q regrouped as [B, g, Hkv, D]) and whose log-sum-exp is a
  contiguous float32 [B, Hq, Sq].
- `install(setattr)`: puts `sdpa` in place of torch's function (`monkeypatch.setattr`, or plain `setattr`).
- `KernelLayouts`: what conftest's `kernel_layouts` fixture gives a test (`.cuda`, `.flash(stand_in)`).
- `SITE`: a folder that, first on a subprocess's PYTHONPATH, installs `sdpa` in it at startup (`subprocess_env`),
  so that `kvrescue run` in a subprocess computes with CUDA's layouts too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

TORCH_SDPA = F.scaled_dot_product_attention
SITE = Path(__file__).parent / "cuda_layouts_site"


def heads_outer(out: torch.Tensor) -> torch.Tensor:
    """out [B, H, M, D] with the same values, laid out in memory as [B, M, H, D]."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """torch's scaled_dot_product_attention, its output laid out as CUDA's memory-efficient kernel lays it out."""
    out = TORCH_SDPA(query, key, value, *args, **kwargs)
    return heads_outer(out) if out.dim() == 4 else out


def _flash_out(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """An empty output for q [B, Sq, Hq, D] allocated as mha_fwd_kvcache allocates it."""
    B, Sq, Hq, D = q.shape
    if Sq == 1 and Hq > kv_heads and D % 8 == 0:  # seqlenq_ngroups_swapped: q regrouped, then back
        regrouped = q.reshape(B, kv_heads, Hq // kv_heads, D).transpose(1, 2)
        return torch.empty_like(regrouped).transpose(1, 2).reshape(B, 1, Hq, D)
    return torch.empty_like(q)


def flash_kvcache(kernel: Callable) -> Callable:
    """`kernel` (flash_attn_with_kvcache's signature and values) returning flash-attn's layouts."""

    def with_flash_layouts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *args, **kwargs):
        result = kernel(q, k_cache, v_cache, *args, **kwargs)
        out, lse = result if isinstance(result, tuple) else (result, None)
        laid_out = _flash_out(q, k_cache.shape[2]).copy_(out)
        if lse is None:
            return laid_out
        return laid_out, lse.contiguous()

    return with_flash_layouts


def install(setattr_: Callable = setattr) -> None:
    """Make torch's scaled_dot_product_attention return CUDA's layouts (the engine calls it as F.<name>)."""
    setattr_(F, "scaled_dot_product_attention", sdpa)


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with SITE first on PYTHONPATH: a Python started with it uses `sdpa`."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH")) if p)
    return env


class KernelLayouts:
    """The memory layouts the attention kernels of a test return: the CPU's own (`cuda` False) or CUDA's."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def flash(self, kernel: Callable) -> Callable:
        """A flash_attn_with_kvcache stand-in, returning flash-attn's layouts under CUDA's."""
        return flash_kvcache(kernel) if self.cuda else kernel
