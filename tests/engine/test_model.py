"""The engine's decoder equals transformers on random Qwen2, Qwen3 and Llama checkpoints saved to disk."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvrescue.engine import FullCache, ModelLoadError, load_model
from kvrescue.engine.loader import cpu_has_native_bf16, resolve_dtype
from kvrescue.engine.model import RMSNorm, linear
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts

TOL = 1e-4


@pytest.fixture(params=["qwen2_dir", "qwen3_dir", "llama_dir"])
def pair(request):
    folder = request.getfixturevalue(request.param)
    ours = load_model(folder, dtype="float32", device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, ref


def test_plain_logits_match_transformers(pair) -> None:
    ours, ref = pair
    ids = torch.randint(0, len(ours.tokenizer), (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours.logits(ids)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got - expected).abs().max() < TOL


def test_cached_prefill_and_decode_match_transformers(pair) -> None:
    """Rows of different lengths in one batch: prefill through the cache, then one token at a time."""
    ours, ref = pair
    g = torch.Generator().manual_seed(1)
    lengths = [9, 4, 13]
    seqs = [torch.randint(0, len(ours.tokenizer), (n + 6,), generator=g) for n in lengths]
    cache = FullCache.for_model(ours.net, 512, max_rows=8, block_size=4)
    rows = [cache.create() for _ in seqs]
    batch = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        batch[i, :n] = s[:n]
    with torch.no_grad():
        refs = [ref(s[None]).logits[0] for s in seqs]
        prefill = ours.net.prefill(batch, cache, rows, lengths, last_only=False)
        for i, n in enumerate(lengths):
            assert (prefill[i, :n] - refs[i][:n]).abs().max() < TOL
        for t in range(6):
            step = torch.stack([s[n + t] for s, n in zip(seqs, lengths)])
            out = ours.net.decode(step, cache, rows)
            for i, n in enumerate(lengths):
                assert (out[i] - refs[i][n + t]).abs().max() < TOL
    assert [cache.length(r) for r in rows] == [n + 6 for n in lengths]


@pytest.mark.parametrize("folder", ["qwen2_dir", "qwen3_dir"])
def test_a_gguf_file_loads_as_its_safetensors_checkpoint(request, tmp_path, folder) -> None:
    """A GGUF file written from a checkpoint as llama.cpp writes one (the Qwen3's head size, 32, is not
    Qwen3Config's default): the engine's logits on it equal transformers' on the safetensors original, and its
    tokenizer (built by transformers from the file's vocabulary and merges) and EOS ids equal the original's."""
    folder = request.getfixturevalue(folder)
    ours = load_model(write_gguf(folder, tmp_path / "m.gguf"))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, len(ours.tokenizer), (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits
    assert (ours.logits(ids) - expected).abs().max() < TOL
    text = "<|im_start|>user\nStep 1: 3x + 5 = 20, so x = 5.\n\n<|im_end|>"
    assert ours.tokenizer.encode(text) == AutoTokenizer.from_pretrained(folder).encode(text)
    assert ours.eos_ids == load_model(folder).eos_ids


def test_prefill_returns_last_position_logits(qwen2_dir) -> None:
    ours = load_model(qwen2_dir)
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
    cache = FullCache.for_model(ours.net, 256, max_rows=4)
    rows = [cache.create(), cache.create()]
    with torch.no_grad():
        last = ours.net.prefill(ids, cache, rows, [8, 5])
    full = ours.logits(ids)
    assert (last[0] - full[0, 7]).abs().max() < TOL
    assert (last[1] - full[1, 4]).abs().max() < TOL


def test_dtypes_load(qwen2_dir) -> None:
    m = load_model(qwen2_dir, dtype="bf16")
    assert m.dtype == torch.bfloat16
    assert m.logits(torch.tensor([[1, 2, 3]])).dtype == torch.float32
    assert m.tokenizer is not None and m.config["model_type"] == "qwen2" and m.eos_ids


CPUINFO = "processor\t: {n}\nmodel name\t: some cpu\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\n"


def test_auto_dtype_is_bf16_on_cuda_and_on_cpus_with_native_bf16_matmuls() -> None:
    assert not cpu_has_native_bf16(CPUINFO.format(n=0, extra="avx512vl") * 2)
    assert cpu_has_native_bf16(CPUINFO.format(n=0, extra="avx512_bf16"))
    assert cpu_has_native_bf16(CPUINFO.format(n=0, extra="amx_tile amx_bf16 amx_int8"))
    assert not cpu_has_native_bf16("model name\t: avx512_bf16 in a name is no flag\n")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    here = "bfloat16" if any(f in flags.split() for f in ("avx512_bf16", "amx_bf16")) else "float32"
    assert resolve_dtype("auto", "cpu") == here
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cuda:0") == "float16" and resolve_dtype("float32", "cpu") == "float32"


def test_hub_id_without_network_fails_with_one_clear_line(monkeypatch) -> None:
    """No network here (and forced offline where there is): the error names the model and what is missing."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as e:
        load_model("Qwen/Qwen2.5-Math-1.5B-Instruct")
    msg = str(e.value)
    assert "Qwen/Qwen2.5-Math-1.5B-Instruct" in msg and "\n" not in msg


def test_a_hub_repo_s_pytorch_weight_files_are_fetched_only_where_it_has_no_safetensors(monkeypatch, tmp_path) -> None:
    import huggingface_hub

    from kvrescue.engine.loader import model_folder

    asked = []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no probe of the Hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, allow_patterns, **where:
                        asked.append(allow_patterns) or str(tmp_path))
    assert model_folder("Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B") == tmp_path
    assert len(asked) == 2 and "*.safetensors" in asked[0] and asked[1] == asked[0] + ["pytorch_model*.bin"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    asked.clear()
    model_folder("Qwen/Qwen2.5-Math-PRM-7B")
    assert len(asked) == 1 and not any(".bin" in pattern for pattern in asked[0])


def test_missing_path_is_refused(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "nope" / "x.gguf")


def test_random_checkpoint_with_a_larger_vocabulary_than_its_tokenizer(tmp_path) -> None:
    """Qwen2.5 pads its embedding past the tokenizer; the writer and both loaders agree on that too."""
    from kvrescue_testkit.random_checkpoints import write_random_checkpoint

    folder = write_random_checkpoint(tmp_path, "qwen2", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                     intermediate_size=64, vocab_size=1000)
    ours = load_model(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = ref(ids).logits
    assert ours.logits(ids).shape == (1, 4, 1000) and len(ours.tokenizer) < 1000
    assert (ours.logits(ids) - expected).abs().max() < TOL


@pytest.mark.parametrize("rows", [1, 5, 32, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_equals_exact_matmul(rows, dtype) -> None:
    """`linear` (matrix-vector products for few bf16 rows on a CPU, else F.linear) against float64 x @ WT + b."""
    g = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 1, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    exact = x.double() @ weight.double().T + bias.double()
    for b in (bias, None):
        got = linear(x, weight, b)
        assert got.shape == (rows, 1, 80) and got.dtype == dtype and got.is_contiguous()
        want = exact if b is not None else exact - bias.double()
        assert (got.double() - want).abs().max() <= (8e-3 if dtype == torch.bfloat16 else 1e-4) * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rms_norm_equals_transformers_exactly(dtype) -> None:
    """RMSNorm (rms_norm of x in its own dtype, which computes in fp32) equals transformers' Qwen2RMSNorm (x.float(),
    its variance, rounded back, then the weight) bit for bit."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(896, generator=g)
    ours, theirs = RMSNorm(896, 1e-6), Qwen2RMSNorm(896, 1e-6)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        for scale in (1e-3, 1.0, 30.0, 1e3):
            x = (torch.randn(3, 5, 896, generator=g) * scale).to(dtype)
            assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("change, says", [
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3 MoE checkpoints (model_type "
     "'qwen3_moe') are not supported"),
    ({"attention_bias": True}, "unsupported attention_bias: an o_proj bias is not implemented"),
    ({"use_sliding_window": True}, "unsupported use_sliding_window"),
])
def test_qwen3_variants_the_engine_does_not_run_are_one_line_errors(qwen3_dir, tmp_path, change, says) -> None:
    import shutil

    import orjson

    folder = shutil.copytree(qwen3_dir, tmp_path / "variant")
    config = orjson.loads((folder / "config.json").read_bytes())
    (folder / "config.json").write_bytes(orjson.dumps({**config, **change}))
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    assert says in str(e.value) and "\n" not in str(e.value)
