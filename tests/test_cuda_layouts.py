"""The CUDA-layout kernels the engine's tests run under (`tests.cuda_layouts`): CUDA's strides, the same values."""

import subprocess
import sys

import torch
import torch.nn.functional as F

from tests import cuda_layouts


def test_sdpa_returns_the_memory_efficient_kernel_s_layout():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True
    out = cuda_layouts.sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out, cuda_layouts.TORCH_SDPA(q, k, v, attn_mask=mask))
    assert out.stride() == (5 * 4 * 8, 8, 4 * 8, 1)  # [B, H, M, D] laid out as [B, M, H, D]
    assert not out.is_contiguous()


def reference_kvcache(q, k_cache, v_cache):
    """A stand-in returning contiguous results: out [B, Sq, Hq, D] and lse [B, Hq, Sq] laid out as [B, Sq, Hq]."""
    B, Sq, Hq, D = q.shape
    return torch.ones(B, Sq, Hq, D), torch.ones(B, Sq, Hq).transpose(1, 2)


def test_flash_stand_ins_return_flash_attn_s_layouts():
    kernel = cuda_layouts.flash_kvcache(reference_kvcache)
    caches = torch.zeros(3, 16, 2, 8), torch.zeros(3, 16, 2, 8)
    dense = torch.zeros(3, 6, 5, 8).transpose(1, 2)  # the engine passes q [S, Hq, T, D] transposed
    out, lse = kernel(dense, *caches)
    assert out.stride() == dense.stride() and lse.is_contiguous() and torch.equal(out, torch.ones(3, 5, 6, 8))
    sliced = torch.zeros(3, 9, 5, 8)[:, :6].transpose(1, 2)  # not dense: dense strides in q's order
    assert kernel(sliced, *caches)[0].stride() == (6 * 5 * 8, 8, 5 * 8, 1)
    one = torch.zeros(3, 6, 1, 8).transpose(1, 2)  # one query, grouped heads: q regrouped [B, g, Hkv, D]
    assert kernel(one, *caches)[0].shape == (3, 1, 6, 8)


def test_the_fixture_puts_the_cuda_layouts_where_the_engine_calls_sdpa(kernel_layouts):
    from kvrescue.engine import attention, model

    installed = F.scaled_dot_product_attention is cuda_layouts.sdpa
    assert installed == kernel_layouts.cuda
    assert (attention.F.scaled_dot_product_attention is cuda_layouts.sdpa) == installed
    assert (model.F.scaled_dot_product_attention is cuda_layouts.sdpa) == installed


def test_a_subprocess_started_with_its_environment_computes_with_them():
    code = "import torch.nn.functional as F; print(F.scaled_dot_product_attention.__module__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=cuda_layouts.subprocess_env())
    assert done.stdout.strip() == "cuda_layouts"
