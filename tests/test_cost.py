"""`kvrescue cost`: the paper's Table 4 constants and Appendix D quantities from config.json files."""

import subprocess
import sys

import orjson
import pytest
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.cost import Architecture, estimate
from kvrescue.model_config import ModelConfigError, load_config
from kvrescue.errors import InputError
from tests.helpers import paper_grid, small_cell, small_grid

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
    base = 2 * 7_615_616_512 + (1 + 2.9) * 4 * 28 * 28 * 128 * 192     # Eq. 15: (1 + alpha) x the evicted attention
    assert c.rho == pytest.approx(helper / base)
    assert round(100 * c.rho, 1) == 24.4      # the paper's figure (7B, B = 64); without (1 + alpha): 24.8
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
    assert "56 KiB / 28 KiB" in result.stdout and "768 tokens" in result.stdout   # 3 * (128 + 128)


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
    assert ("nobody/no-such-model-kvrescue: config.json is not in the local Hugging Face cache and the Hub can't be "
            "reached") in " ".join(result.stderr.split())
    assert "Traceback" not in result.output and result.stderr.count("\n") == 1


QWEN_MATH_PRM_7B = {**QWEN_MATH_7B, "architectures": ["Qwen2ForProcessRewardModel"]}


def test_rank_params_split_heads_mlp_and_vocab():
    """One of d ranks: 1/d of q, o, the MLP and the vocab rows; its KV heads (one, replicated, past Hkv)."""
    a = arch(QWEN_MATH_1_5B)
    assert a.rank_params(1) == a.params
    layer = (1536 * 384 + 384) + 2 * (1536 * 128 + 128) + 384 * 1536 + 3 * 1536 * 2240 + 2 * 1536  # 3 q heads, 1 KV
    assert a.rank_params(4) == 28 * layer + 1536 + 37984 * 1536                                    # tied: one matrix
    assert a.rank_kv_bytes_per_token(4) == a.kv_bytes_per_token // 2                              # 1 of 2 KV heads
    prm = arch(QWEN_MATH_PRM_7B)  # the score head replaces the LM head
    assert prm.params == arch(QWEN_MATH_7B).params - 152064 * 3584 + 3584 * 3584 + 3584 + 2 * 3584 + 2


def test_cli_cost_tp_prints_each_devices_plan(tmp_path):
    """The paper's Table 3 setting: the 72B base, the 1.5B helper and the 7B PRM over 8 devices."""
    for name, cfg in (("base", QWEN_72B), ("helper", QWEN_MATH_1_5B), ("prm", QWEN_MATH_PRM_7B)):
        (tmp_path / f"{name}.json").write_bytes(orjson.dumps(cfg))
    args = ["cost", "--base", str(tmp_path / "base.json"), "--helper", str(tmp_path / "helper.json"),
            "--prm", str(tmp_path / "prm.json"), "--tp", "8", "--batch", "2"]
    result = CliRunner().invoke(app, args + ["--format", "json"])
    assert result.exit_code == 0, result.output
    plan = {m["role"]: m for m in orjson.loads(result.stdout)["devices"]}
    assert [plan[r]["ranks"] for r in ("base", "helper", "prm")] == [8, 4, 4]
    assert plan["base"]["weights_bytes"] == 2 * arch(QWEN_72B).rank_params(8)
    # What the run allocates (the planner's): the base pool's rows (batch x (N + 1) + the graphs' scratch slot) x
    # (B' + the longest step) entries of one of 8 KV heads, and its query rings of 8 of 64 query heads
    assert plan["base"]["kv_bytes"] == 19 * 704 * 320 * 1024 // 8 + 80 * 19 * 8 * 8 * 128 * 2
    # batch x (L + 2N steps) and the CUDA graphs' scratch block of 16, 1 of 2 KV heads
    assert plan["helper"]["kv_bytes"] == (2 * (4096 + 2 * 8 * 512) + 16) * 14 * 1024
    # windows + 2N suffixes and the CUDA graphs' scratch block, 1 of 4 KV heads
    assert plan["prm"]["kv_bytes"] == (2 * (4096 + 16) + 2 * 16 * 529 + 16) * 14 * 1024
    assert plan["prm"]["activation_bytes"] > 0 and orjson.loads(result.stdout)["device_bytes"] > sum(
        m["weights_bytes"] + m["kv_bytes"] for m in plan.values())
    table = CliRunner().invoke(app, args, env={"COLUMNS": "200"})  # wide enough for each label on one line
    assert "base (8 ranks per copy) weights / KV" in table.stdout and "total" in table.stdout
    wrong = CliRunner().invoke(app, ["cost", "--base", str(tmp_path / "prm.json"), "--helper",
                                     str(tmp_path / "helper.json"), "--tp", "8"])
    assert wrong.exit_code == 2 and wrong.stderr.count("\n") == 1
    assert "--tp 8 must divide the base's 28 query heads, 4 KV heads" in wrong.stderr


def test_a_run_that_does_not_fit_the_free_device_memory_is_refused(tmp_path):
    """The paper's Table 3 models in bf16, N = 8, B = 64, 8 problems at once: one 40 GB device is far too
    small, eight fit; the check reads only config.json files."""
    from dataclasses import replace

    from kvrescue.device_plan import refuse_what_does_not_fit

    models = {}
    for role, cfg in (("base", QWEN_72B), ("helper", QWEN_MATH_1_5B), ("prm", QWEN_MATH_PRM_7B)):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_bytes(orjson.dumps(cfg))
        models[role] = str(tmp_path / role)
    options = paper_grid(tmp_path, models)
    with pytest.raises(InputError, match=r"batch 8 needs 1\d\d\.\d GiB on cuda:0 \(base 135\.4 GiB \+ KV \d+\.\d GiB "
                                         r"\+ buffers .* but 40\.0 GiB is free \(38\.0 GiB after 2\.0 GiB of headroom\); "
                                         r"lower --batch \(or --batch auto\) or --n, or use larger devices"):
        refuse_what_does_not_fit(options.group_plan(), 40 * 2**30)
    eight = replace(options, devices=tuple(f"cuda:{i}" for i in range(8)), tp=8)
    refuse_what_does_not_fit(eight.group_plan(), 40 * 2**30)
    with pytest.raises(InputError, match=r"batch 8 needs [23]\d\.\d GiB on cuda:0"):
        refuse_what_does_not_fit(eight.group_plan(), 20 * 2**30)


def test_the_plan_counts_the_caches_a_cell_builds(qwen2_dir, llama_dir, prm_dir, tmp_path):
    """The K/V the plan counts per role is what the run's caches allocate, on the random checkpoints."""
    from kvrescue.cell_runners import build_cell
    from kvrescue.device_plan import plan_for_device
    from kvrescue.group_models import load_roles
    from kvrescue.search import SearchSettings

    models = {"base": str(qwen2_dir), "helper": str(qwen2_dir), "prm": str(prm_dir)}
    options = small_grid(tmp_path, SearchSettings(batch=3, max_step_tokens=64, context_cap=200), methods=["kvrescue"],
                         models=models)
    loaded = load_roles(options.group_plan(), "cpu")
    cell = small_cell(method="kvrescue")
    engine = build_cell(options.plan_of(cell), loaded)
    caches = {role: runner.cache for role, runner in engine.runners.items()}
    caches["prm"] = engine.scorer.cache
    plan = plan_for_device(options.group_plan(), "cpu")
    for role, cache in caches.items():
        built = cache.k.nbytes + cache.v.nbytes + (cache.q.nbytes if hasattr(cache, "q") else 0)
        assert plan.bytes(role, "kv") == built, role


def test_vllm_gets_its_share_and_this_engine_the_rest(tmp_path):
    """--engine vllm: the helper and the PRM on vLLM, an even split of --vllm-memory each, holding its weights and
    one whole context; the evicted base's plan in the rest of the GPU; on a CPU, the share within free RAM."""
    from kvrescue.device_plan import plan_for_device, vllm_memory
    from kvrescue.grid import GridOptions
    from kvrescue.search import SearchSettings

    models = {}
    for role, cfg in (("base", QWEN_MATH_7B), ("helper", QWEN_MATH_1_5B), ("prm", QWEN_MATH_PRM_7B)):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_bytes(orjson.dumps(cfg))
        models[role] = str(tmp_path / role)

    def options(memory: float, methods=("kvrescue",), batch: int = 8) -> GridOptions:
        return small_grid(tmp_path, SearchSettings(batch=batch), methods=list(methods), budgets=[64], ns=[8],
                          models=models, dtype="bfloat16", engine="vllm", vllm_memory=memory)

    gib = 2**30
    assert options(0.4).group_plan().vllm_models().keys() == {"helper", "prm"}
    assert options(0.4).group_plan().native_models().keys() == {"base"}
    assert options(0.4, ("full", "bon")).group_plan().vllm_models().keys() == {"base", "prm"}
    assert options(0.4, ("full", "bon")).group_plan().native_models().keys() == {"base"}  # bon's evicted base: here
    assert plan_for_device(options(0.4).group_plan()).roles == ["base"]
    assert vllm_memory(options(0.4).group_plan(), "cuda:0", 80 * gib, 80 * gib) == [{"memory": 0.2}, {"memory": 0.2}]
    with pytest.raises(InputError, match=r"--vllm-memory 0.1: vLLM's 8.00 GiB of cuda:0 over its 2 engine\(s\) "
                                         r"leaves 4.00 GiB for the prm model, whose weights and one 4096-token "
                                         r"context need 13\.4\d GiB; raise --vllm-memory"):
        vllm_memory(options(0.1).group_plan(), "cuda:0", 80 * gib, 80 * gib)
    with pytest.raises(InputError, match=r"GiB is left beside vLLM's share \(.*\); lower --batch \(or --batch auto\) "
                                         r"or --n, --vllm-memory, or use larger devices"):
        vllm_memory(options(0.45, batch=128).group_plan(), "cuda:0", 80 * gib, 80 * gib)
    (helper, prm) = vllm_memory(options(0.4).group_plan(), "cpu", 40 * gib, 80 * gib)
    assert helper["kv_cache_bytes"] == 16 * gib - Architecture.from_config("h", QWEN_MATH_1_5B).params * 2
    with pytest.raises(InputError, match=r"--vllm-memory 0.6: 48.0 GiB of RAM for vLLM, but 40.0 GiB is available"):
        vllm_memory(options(0.6).group_plan(), "cpu", 40 * gib, 80 * gib)
    assert vllm_memory(replace_engine(options(0.4)).group_plan(), "cuda:0", 80 * gib, 80 * gib) == []


def replace_engine(options):
    from dataclasses import replace

    return replace(options, engine="native")


# Runs the `kvrescue` entry point (cli.app) with the given arguments, then says whether torch was imported.
TORCH_IMPORTED = """
import sys
from kvrescue.cli import app
try:
    app(sys.argv[1:])
except SystemExit as end:
    assert not end.code, end.code
print("torch imported:", "torch" in sys.modules)
"""


def test_cost_and_help_start_without_torch(tmp_path):
    for name, cfg in (("base", QWEN_MATH_7B), ("helper", QWEN_MATH_1_5B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(orjson.dumps(cfg))
    cost = ["cost", "--base", str(tmp_path / "base"), "--helper", str(tmp_path / "helper"), "--format", "json"]
    for args in (cost, ["--help"]):
        done = subprocess.run([sys.executable, "-c", TORCH_IMPORTED, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "torch imported: False", args
