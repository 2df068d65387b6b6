"""Batch invariance (`--deterministic`, docs/reproducibility.md): every row's result of a forward is the same
whatever other rows share the forward, its padded length and its row count.

Measured on oneDNN/MKL (tests/engine/test_invariance.py probes every op): a bf16 matrix product gives each row
the same result from 1 to 32 rows and another from 33 on; an fp32 one another for one row than for two, and
from two on one that changes with the shape and the thread count (at 576 x 576 on two threads, from 4 rows).
SDPA's CPU flash kernel reduces keys in blocks of KEY_GRANULE (one block of all keys below it) and queries in
blocks whose size follows their count; torch splits a lone row's sum over threads. So with the mode on, linears
run in row chunks that keep one kernel, keys are padded to whole KEY_GRANULE blocks, each query token attends as
a decode step does (its heads sharing a KV head as one block), and long sums go in fixed partial sums. The mode
is a process-wide switch, set where a cell's engine is built.

On CUDA (not testable on this project's CPUs; docs/reproducibility.md says what holds there) the mode takes the
batch-invariant choices that exist: flash-attn's decode with one KV split (`flash_splits`: its split-KV heuristic
follows the batch), and cuBLAS without split-K, by the workspace settings vLLM's batch-invariant mode uses on
Hopper and Blackwell (`prepare_cuda`, before the process's first matrix product); Ampere's cuBLAS has no such
setting, so the mode is refused there.
"""

import os

import torch

from kvrescue.errors import InputError

KEY_GRANULE = 512  # SDPA's CPU flash kernel's key block (kv_split_size)
# Rows per chunk of a CPU linear, and the fewest rows a chunk is padded to, per dtype (see the module docstring).
LINEAR_ROWS = {torch.bfloat16: (32, 1), torch.float32: (8, 8)}
SUM_CHUNK = 4096  # elements per partial sum of `row_sum`

_on = [False]


def enable(on: bool) -> None:
    """Turn batch invariance on or off for this process."""
    _on[0] = on


# vLLM's model_executor/determinism/batch_invariant.py: on SM90 and SM100 split-K, cuBLAS's only source of batch
# variance, is off with these workspace settings (read once, at the process's first cuBLAS call).
CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
CUDA_CAPABILITY = (9, 0)  # the oldest GPUs whose cuBLAS the settings make batch-invariant (Hopper)


def prepare_cuda(device: str) -> None:
    """Set up this process for the mode on a CUDA `device`, before any matrix product runs: cuBLAS without
    split-K (CUBLAS_ENV) and without reduced-precision or TF32 reductions, cuBLASLt preferred. A one-line error on
    a GPU older than CUDA_CAPABILITY."""
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < CUDA_CAPABILITY:
        raise InputError(f"--deterministic on {device} (compute capability {capability[0]}.{capability[1]}): "
                         "cuBLAS has no batch-invariant setting before Hopper (9.0); run without it, or on a CPU")
    os.environ.update(CUBLAS_ENV)
    matmul = torch.backends.cuda.matmul
    # (reduced-precision reduction, its split-K): neither, as vLLM sets them; fp32 products in IEEE fp32, not TF32
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = (False, False)
    matmul.fp32_precision = "ieee"
    torch.backends.cuda.preferred_blas_library("cublaslt")


def on() -> bool:
    """Whether the mode is on in this process (on any device)."""
    return _on[0]


def flash_splits() -> int:
    """flash-attn's `num_splits`: one KV split with the mode on, else 0 (its heuristic, which follows the batch)."""
    return 1 if on() else 0


def active(x: torch.Tensor) -> bool:
    """Whether the mode governs an op on `x`: it is on, and x is on a CPU."""
    return on() and x.device.type == "cpu"


def padded_keys(length: int) -> int:
    """Keys an attention reads for `length` visible ones: whole KEY_GRANULE blocks."""
    return -(-length // KEY_GRANULE) * KEY_GRANULE


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel) -> torch.Tensor:
    """kernel(x, weight, bias) for x [..., in]; with the mode on, over x's rows in chunks of LINEAR_ROWS (a short
    last chunk padded to the fewest rows), so that every row goes through the same kernel whatever the row count."""
    if not active(x):
        return kernel(x, weight, bias)
    chunk, fewest = LINEAR_ROWS.get(x.dtype, (1, 1))
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    parts = []
    for start in range(0, rows, chunk):
        part = flat[start : start + chunk]
        n = part.shape[0]
        if n < fewest:
            part = torch.cat([part, part.new_zeros(fewest - n, part.shape[1])])
        parts.append(kernel(part, weight, bias)[:n])
    return torch.cat(parts).reshape(*x.shape[:-1], weight.shape[0])


def attend_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [R, Hq, T, D] over k, v [R, Hkv, L, D] (L whole KEY_GRANULE blocks), bias [R, T or 1, L] or
    [R, Hkv, T or 1, L] (0 visible, -inf not), each query token as a decode step: its g = Hq / Hkv heads of KV head
    j one query block of SDPA's CPU flash kernel; one kernel call per token (all rows) or per row (all its tokens, its
    keys shared, not copied), whichever is fewer. Returns out [R, Hq, T, D] and the log-sum-exp [R, Hq, T] (fp32)."""
    R, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    g = Hq // Hkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bias = bias if bias.dim() == 4 else bias[:, None]
    heads = bias.shape[1]
    bias = bias.expand(R, heads, T, L)
    if T <= R:
        parts = [flash(q[:, :, t].reshape(R, Hkv, g, D), k, v, attn_mask=bias[:, :, t, None].expand(R, heads, g, L))
                 for t in range(T)]
        return (torch.stack([out.reshape(R, Hq, D) for out, _ in parts], 2),
                torch.stack([lse.reshape(R, Hq) for _, lse in parts], 2))
    outs, lses = [], []
    for r in range(R):
        queries = q[r].reshape(Hkv, g, T, D).permute(2, 0, 1, 3)  # [T, Hkv, g, D]
        mask = bias[r].transpose(0, 1)[:, :, None].expand(T, heads, g, L)
        out, lse = flash(queries, k[r : r + 1].expand(T, -1, -1, -1), v[r : r + 1].expand(T, -1, -1, -1),
                         attn_mask=mask)
        outs.append(out.permute(1, 2, 0, 3).reshape(Hq, T, D))
        lses.append(lse.permute(1, 2, 0).reshape(Hq, T))
    return torch.stack(outs), torch.stack(lses)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1); with the mode on, in partial sums of SUM_CHUNK elements (zero padded) then their sum, so that no
    row's sum is split among threads when the rows are few (torch parallelises a lone row's sum over its
    elements, several rows' over the rows)."""
    if not active(x):
        return x.sum(-1)
    pad = -x.shape[-1] % SUM_CHUNK
    x = torch.nn.functional.pad(x, (0, pad)) if pad else x
    return x.reshape(*x.shape[:-1], -1, SUM_CHUNK).sum(-1).sum(-1)
