"""`kvrescue cost`: the paper's Table 4 constants and Appendix D quantities from config.json files."""

import orjson
import pytest
from typer.testing import CliRunner

from kvrescue_cli.cli import app
from kvrescue_cli.cost import Architecture, estimate
from kvrescue_cli.model_config import ModelConfigError, load_config

# Values from each model's config.json on the Hugging Face Hub.
QWEN_MATH_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN_72B = {"model_type": "qwen2", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
            "num_hidden_layers": 80, "intermediate_size": 29568, "vocab_size": 152064,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN_MATH_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
                  "num_hidden_layers": 28, "intermediate_size": 8960, "vocab_size": 151936,
                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def arch(cfg: dict) -> Architecture:
    return Architecture.from_config("m", cfg)


def test_table4_kv_bytes_per_token():
    assert arch(QWEN_MATH_7B).kv_bytes_per_token == 56 * 1024      # 2 * 28 * 4 * 128 * 2
    assert arch(QWEN_72B).kv_bytes_per_token == 320 * 1024         # 2 * 80 * 8 * 128 * 2
    assert arch(QWEN_MATH_1_5B).kv_bytes_per_token == 28 * 1024    # 2 * 28 * 2 * 128 * 2


def test_table4_dense_flops_are_twice_the_total_parameters():
    # 7B per layer: q 3584*3584+3584, k/v 2*(3584*512+512), o 3584*3584, MLP 3*3584*18944, norms 2*3584
    layer = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    params = 28 * layer + 3584 + 2 * 152064 * 3584                 # + final norm, embedding, LM head
    assert arch(QWEN_MATH_7B).params == params == 7_615_616_512
    assert round(arch(QWEN_MATH_7B).dense_flops / 1e9, 1) == 15.2
    assert round(arch(QWEN_72B).dense_flops / 1e9, 1) == 145.4
    # The non-embedding count would give 13.1 GFLOP, not the paper's 15.2.
    assert round(2 * (params - 2 * 152064 * 3584) / 1e9, 1) == 13.1
    assert arch(QWEN_MATH_1_5B).params == 1_543_714_304          # tied embeddings counted once


def test_estimate_by_hand():
    c = estimate(arch(QWEN_MATH_7B), arch(QWEN_MATH_1_5B), budget=64, context=4096, n=8, alpha=2.9)
    assert c.physical_budget == 192
    assert c.base_full_kv_bytes == 56 * 1024 * 4096 == 224 * 2**20
    assert c.base_evicted_kv_bytes == 56 * 1024 * 192
    assert c.base_evicted_kv_bytes_n == 8 * 56 * 1024 * 192
    assert c.helper_kv_bytes_n == 8 * 28 * 1024 * 4096
    assert c.kvrescue_kv_bytes_n == c.base_evicted_kv_bytes_n + c.helper_kv_bytes_n
    assert c.base_full_attention_flops == 4 * 28 * 28 * 128 * 4096
    assert c.base_evicted_attention_flops == 4 * 28 * 28 * 128 * 192
    assert c.crossover_context == pytest.approx(3.9 * 192)
    helper = 2 * 1_543_714_304 + 4 * 28 * 12 * 128 * 4096
    base = 2 * 7_615_616_512 + 4 * 28 * 28 * 128 * 192
    assert c.rho == pytest.approx(helper / base)
    assert c.rho_dense == pytest.approx(1_543_714_304 / 7_615_616_512)
    short = estimate(arch(QWEN_MATH_7B), arch(QWEN_MATH_1_5B), budget=64, context=100)
    assert short.base_evicted_kv_bytes == short.base_full_kv_bytes    # context below B': nothing evicted


def test_cli_cost_from_local_folders(tmp_path):
    for name, cfg in (("base", QWEN_MATH_7B), ("helper", QWEN_MATH_1_5B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(orjson.dumps(cfg))
    runner = CliRunner()
    result = runner.invoke(app, ["cost", "--base", str(tmp_path / "base"), "--helper",
                                 str(tmp_path / "helper" / "config.json"), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    assert data["base_kv_bytes_per_token"] == 57344 and data["helper_kv_bytes_per_token"] == 28672
    assert data["physical_budget"] == 192 and data["n"] == 8
    result = runner.invoke(app, ["cost", "--base", str(tmp_path / "base"), "--helper", str(tmp_path / "helper"),
                                 "--budget", "128", "--alpha", "2"])
    assert result.exit_code == 0
    assert "56 KiB / 28 KiB" in result.stderr and "768 tokens" in result.stderr   # 3 * (128 + 128)


def test_missing_or_bad_configs_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelConfigError, match="no such folder"):
        load_config(str(tmp_path / "nope"))
    with pytest.raises(ModelConfigError, match="GGUF"):
        load_config("model.Q4.gguf")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="lacks"):
        Architecture.from_config("x", load_config(str(tmp_path)))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)    # no network attempts
    result = CliRunner().invoke(app, ["cost", "--base", "nobody/no-such-model-kvrescue", "--helper", str(tmp_path)])
    assert result.exit_code != 0
    assert "nobody/no-such-model-kvrescue: could not fetch config.json" in result.stderr
    assert "Traceback" not in result.output and result.stderr.count("\n") == 1
