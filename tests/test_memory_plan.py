"""The memory planner against the bytes a real cell allocates on the CPU, and its uses (refusal, --batch auto)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from kvrescue import device_plan, engine_bytes, in_process, memory_fit, memory_plan
from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue.errors import InputError
from kvrescue.group_models import load_roles
from kvrescue.data import Problem
from kvrescue.grid import GridOptions
from kvrescue.prompts import generation_prompt
from kvrescue_testkit.random_checkpoints import build_tokenizer, write_random_checkpoint
from kvrescue.search import SearchSettings
from tests.helpers import paper_grid, small_cell, small_grid, unset_allocator_settings
from tests.tensor_bytes import TensorBytes, parameter_bytes

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, init_std=0.1)
STEP_TOKEN = "!"  # re-encodes to itself, one token each, and never makes a step delimiter


@pytest.fixture(scope="module")
def worst_case_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Qwen2 checkpoint that samples `!` after every token (its layers' outputs zeroed, so the last hidden state
    is the embedding's direction, which only `!`'s head row follows), and a PRM: every step then has exactly the
    tokens it was given, in the policy's and the PRM's tokenizer alike, so a cell reaches the shapes it is planned
    for (its longest steps, its whole context)."""
    from safetensors.torch import load_file, save_file

    policy = write_random_checkpoint(tmp_path_factory.mktemp("bang"), "qwen2", seed=7, **SHAPE)
    weights = load_file(policy / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    weights["model.embed_tokens.weight"][:] = 1.0
    weights["model.norm.weight"][:] = 1.0
    weights["lm_head.weight"][build_tokenizer().convert_tokens_to_ids(STEP_TOKEN)] = 1.0
    save_file(weights, policy / "model.safetensors", metadata={"format": "pt"})
    prm = write_random_checkpoint(tmp_path_factory.mktemp("bang-prm"), "prm", seed=8, **SHAPE)
    return policy, prm


def measured_cell(policy: Path, prm: Path, method: str, scorer: str, batch: int, n: int, step: int, cap: int,
                  tmp_path: Path) -> tuple[int, memory_plan.DevicePlan]:
    """Weights + the peak bytes of the tensors live during one real cell (synthetic steps of `step` tokens until
    the context cap), and the planner's plan for it with the cell's prompt length."""
    import torch

    models = {"base": str(policy), "helper": str(policy), "prm": str(prm) if scorer == "prm" else scorer}
    settings = SearchSettings(batch=batch, synthetic_steps=(step, 1000), max_step_tokens=step, context_cap=cap)
    options = small_grid(tmp_path, settings, methods=[method], ns=[n], models=models, scorer=scorer, dtype="float32")
    problems = [Problem(i, "What is one plus one?", "2", {}) for i in range(batch)]
    loaded = load_roles(options.group_plan(), "cpu")
    tokenizer = loaded["base" if "base" in loaded else "helper"].tokenizer
    prompt = len(tokenizer.encode(generation_prompt(tokenizer, problems[0].problem), add_special_tokens=False))
    weights = parameter_bytes(*{id(m.net): m.net for m in loaded.values()}.values())
    cell = small_cell(problems, method, n=n)
    cell_plan = options.plan_of(cell)
    mode = TensorBytes()
    with torch.inference_mode(), mode:
        decode_cell(cell_plan, cell, build_cell(cell_plan, loaded), problems, lambda trace, tokens: None)
    shape = replace(memory_plan.cell_shapes(options.cell_plans())[0], prompt_tokens=prompt)
    plan = memory_plan.plan_cell(memory_plan.grid_models(options.group_plan().native_models()), shape,
                                 memory_plan.DeviceKind(dtype_bytes=4))
    return weights + mode.peak, plan


@pytest.mark.parametrize("method, scorer, batch, n, step, cap", [
    ("bon", "prm", 1, 16, 64, 512),       # the PRM scoring 16 candidates over the whole context
    ("kvrescue", "prm", 2, 4, 96, 640),   # base and helper candidates, the base's compression
    ("full", "prm", 2, 2, 128, 640),      # the full base cache, long steps
])
def test_the_plan_is_within_10_percent_of_a_cells_measured_peak(worst_case_dirs, tmp_path, method, scorer, batch,
                                                                 n, step, cap):
    measured, plan = measured_cell(*worst_case_dirs, method, scorer, batch, n, step, cap, tmp_path)
    assert abs(plan.total - measured) <= 0.1 * measured, (plan.total, measured, plan.peak_moment)


# -- the planner's uses ----------------------------------------------------------------------------
def write_paper_configs(folder: Path) -> dict[str, str]:
    """config.json folders of the paper's models (their published values, tests/test_cost.py)."""
    import orjson

    from tests.test_cost import QWEN_72B, QWEN_MATH_1_5B, QWEN_MATH_7B, QWEN_MATH_PRM_7B

    paths = {}
    for name, cfg in (("base-7b", QWEN_MATH_7B), ("base-72b", QWEN_72B), ("helper", QWEN_MATH_1_5B),
                      ("prm", QWEN_MATH_PRM_7B)):
        (folder / name).mkdir()
        (folder / name / "config.json").write_bytes(orjson.dumps(cfg))
        paths[name] = str(folder / name)
    return paths


def run_cli(*args: str):
    """`kvrescue run ...` in this process (no weights are read by --plan)."""
    from typer.testing import CliRunner

    from kvrescue.cli import app

    return CliRunner().invoke(app, ["run", *args])


def test_plan_prints_each_device_and_the_paper_settings_fit(tmp_path):
    """The README's default command on one 80 GB GPU (named, on a CPU-only machine) with --batch auto, the default
    on CUDA; the 72B base at --tp 8 on 8 x 40 GB; and what does not fit: the 72B base on one 80 GB GPU."""
    paths = write_paper_configs(tmp_path)
    seven = ["--base", paths["base-7b"], "--helper", paths["helper"], "--prm", paths["prm"], "--out", str(tmp_path)]
    result = run_cli("--bench", "math500", "--budget", "64", "--n", "8", *seven, "--devices", "cuda:0",
                     "--device-memory", "80GB", "--plan")
    assert result.exit_code == 0, result.output
    batch = int(result.stderr.split("--batch auto: ")[1].split()[0])
    assert batch >= 8, result.stderr
    assert "kvrescue run --plan: batch" in result.stderr and "fits" in result.stderr and "prm" in result.stderr
    eight = ",".join(f"cuda:{i}" for i in range(8))
    result = run_cli("--base", paths["base-72b"], "--helper", paths["helper"], "--prm", paths["prm"], "--out",
                     str(tmp_path), "--devices", eight, "--tp", "8", "--device-memory", "40GB", "--plan")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("usable fits") == 8 and "cuda:7" in result.stderr
    result = run_cli("--base", paths["base-72b"], "--helper", paths["helper"], "--prm", paths["prm"], "--out",
                     str(tmp_path), "--devices", "cuda:0", "--batch", "4", "--device-memory", "80GiB", "--plan")
    assert result.exit_code == 1, result.output
    assert "does not fit: cuda:0: needs" in result.stderr and not (tmp_path / "math500").exists()


def test_batch_auto_is_the_largest_that_fits(tmp_path):
    """--batch auto's batch fits the device with headroom, and one more problem would not."""
    from dataclasses import replace

    paths = write_paper_configs(tmp_path)
    options = paper_grid(tmp_path, {"base": paths["base-7b"], "helper": paths["helper"], "prm": paths["prm"]},
                         devices=("cuda:0",), device_memory=80 * 10**9)
    batch = device_plan.auto_batch(options.group_plan(), [("cuda:0",)])
    room = 80 * 10**9 - memory_fit.headroom(80 * 10**9)
    assert device_plan.plan_for_device(options.group_plan(), "cuda:0", batch).total <= room < \
        device_plan.plan_for_device(options.group_plan(), "cuda:0", batch + 1).total
    shared = device_plan.auto_batch(replace(options, devices=("cuda:0", "cuda:0")).group_plan(),
                                    [("cuda:0",), ("cuda:0",)], 2)
    assert shared < batch  # two workers on one GPU: each plans its half


def test_helper_loglik_counts_both_helper_caches(tmp_path):
    """kvrescue with --prm helper-loglik holds the sampled helper's cache and the scorer's: both are counted."""
    from kvrescue.cost import Architecture
    from kvrescue.model_config import load_config

    paths = write_paper_configs(tmp_path)
    archs = {role: Architecture.from_config(p, load_config(p)) for role, p in (("base", paths["base-7b"]),
                                                                               ("helper", paths["helper"]))}
    cell = memory_plan.CellShape(4, 8, "bounded", 64, True, "helper-loglik")
    plan = memory_plan.plan_cell(archs, cell, memory_plan.DeviceKind(cuda=True, dtype_bytes=2))
    helper = archs["helper"].kv_bytes_per_token // 2 * 2  # bf16
    assert plan.bytes("helper", "kv") == engine_bytes.full_cache_tokens(4, 8, 512, 4096) * helper
    assert plan.bytes("helper-loglik", "kv") == engine_bytes.loglik_cache_tokens(4, 8, 512, 4096) * helper
    assert plan.bytes(None, "weights") == (archs["base"].params + archs["helper"].params) * 2  # the helper once


def test_h2o_counts_the_accumulator_its_cache_allocates(tmp_path):
    """--evictor h2o's cache holds each entry's received attention beside K/V: the plan counts those bytes."""
    from kvrescue.cost import Architecture
    from kvrescue.engine.bounded import BoundedCache
    from kvrescue.model_config import load_config

    options = replace(gpu_options(tmp_path, ("cuda:0",)), evictor="h2o")
    shape = memory_plan.cell_shapes(options.cell_plans())[0]
    rkv = replace(options, evictor="rkv")
    assert shape.accumulates and not memory_plan.cell_shapes(rkv.cell_plans())[0].accumulates
    path = options.models["base"]
    archs = {"base": Architecture.from_config(path, load_config(path))}
    dev = memory_plan.DeviceKind(cuda=True, dtype_bytes=2)
    plain, h2o = (memory_plan.plan_cell(archs, replace(shape, accumulates=a, helper=False, scorer=None), dev)
                  for a in (False, True))
    a = archs["base"].args
    cache = BoundedCache(a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, budget=64, evictor="h2o",
                         max_append=512, rows=8 * 9, device="meta")
    assert h2o.bytes("base", "kv") - plain.bytes("base", "kv") == cache.received.nbytes > 0


@pytest.mark.parametrize("evictor", ["pyramidkv", "adakv"])
def test_an_allocating_evictor_plans_and_allocates_what_rkv_does(tmp_path, evictor):
    """PyramidKV's and Ada-KV's ragged counts live in the same B'-wide pools (holes masked): the same plan, the same
    device bytes."""
    from kvrescue.engine.bounded import BoundedCache

    options = replace(gpu_options(tmp_path, ("cuda:0",)), evictor=evictor)
    assert memory_plan.cell_shapes(options.cell_plans()) == memory_plan.cell_shapes(replace(options, evictor="rkv").cell_plans())
    pools = [BoundedCache(4, 8, 2, 16, budget=64, evictor=e, rows=8, device="meta") for e in (evictor, "rkv")]
    assert [(c.k.shape, c.v.shape, c.q.shape, c.received) for c in pools][0] == \
        [(c.k.shape, c.v.shape, c.q.shape, c.received) for c in pools][1]


def gpu_options(tmp_path: Path, devices: tuple[str, ...], tp: int = 1) -> GridOptions:
    paths = write_paper_configs(tmp_path)
    return paper_grid(tmp_path, {"base": paths["base-7b"], "helper": paths["helper"], "prm": paths["prm"]},
                      devices=devices, tp=tp)


def fake_gpus(monkeypatch, free: Callable[[str], int], total: int = 80 * 2**30) -> None:
    """torch.cuda.mem_get_info answering `free(device)` of `total` bytes, as on a machine with GPUs (whose
    set_device then takes any device)."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free(str(device)), total))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    unset_allocator_settings(monkeypatch)  # use_device sets them


def test_a_tp_group_too_large_for_its_devices_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """--tp 2 on two GPUs, the second nearly full: a one-line error before the group's process group forms (a
    refusal inside it hung the other ranks, or surfaced as a gloo error)."""
    formed = []

    class NoGroup:
        def __init__(self, *args) -> None:
            formed.append(args)
            raise AssertionError("the process group formed before the memory check")

    fake_gpus(monkeypatch, lambda device: 2**30 if device == "cuda:1" else 80 * 2**30)
    monkeypatch.setattr(in_process, "RankGroup", NoGroup)
    with pytest.raises(InputError, match=r"batch 8 needs .* on cuda:1 .* but 1\.0 GiB is free"):
        in_process.InProcessGroup(gpu_options(tmp_path, ("cuda:0", "cuda:1"), tp=2), ("cuda:0", "cuda:1"))
    assert not formed


def test_workers_sharing_a_gpu_each_plan_their_share(tmp_path, monkeypatch):
    """--devices cuda:0,cuda:0: each of the two workers plans half of the GPU, not the whole of it."""
    fake_gpus(monkeypatch, lambda device: 80 * 2**30)
    options = gpu_options(tmp_path, ("cuda:0", "cuda:0")).group_plan()
    need = device_plan.plan_for_device(options, "cuda:0").total
    assert 40 * 2**30 < need < 75 * 2**30  # fits the GPU, not half of it
    device_plan.wait_for_room(options, ("cuda:0",), shares=1)
    with pytest.raises(InputError, match=r"but 40\.0 GiB is free"):
        device_plan.wait_for_room(options, ("cuda:0",), shares=2)


def test_a_restarted_worker_waits_for_its_predecessors_memory(tmp_path, monkeypatch):
    """A restarted worker's check sees the dead process's memory for a while: it waits for it to be released
    rather than stopping the run; a first start does not wait."""
    seconds = [0.0]
    released_at = 20.0
    fake_gpus(monkeypatch, lambda device: 80 * 2**30 if seconds[0] >= released_at else 10 * 2**30)
    options = gpu_options(tmp_path, ("cuda:0",)).group_plan()
    clock, sleep = (lambda: seconds[0]), (lambda s: seconds.__setitem__(0, seconds[0] + s))
    with pytest.raises(InputError, match=r"10\.0 GiB is free"):
        device_plan.wait_for_room(options, ("cuda:0",), clock=clock, sleep=sleep)
    device_plan.wait_for_room(options, ("cuda:0",), wait_s=60.0, clock=clock, sleep=sleep)
    assert seconds[0] == released_at
    seconds[0] = 0.0
    with pytest.raises(InputError, match=r"10\.0 GiB is free"):
        device_plan.wait_for_room(options, ("cuda:0",), wait_s=5.0, clock=clock, sleep=sleep)


def test_cost_and_run_plan_alike(tmp_path):
    """`kvrescue cost`'s per-device figures are the plan `run` refuses and sizes its batch with (they differed: cost
    counted the base ~4x and the PRM ~3x below what the run allocates)."""
    import orjson
    from typer.testing import CliRunner

    from kvrescue.cli import app

    options = gpu_options(tmp_path, ("cuda:0",))
    paths = options.models
    result = CliRunner().invoke(app, ["cost", "--base", paths["base"], "--helper", paths["helper"], "--prm",
                                      paths["prm"], "--batch", "8", "--format", "json"])
    assert result.exit_code == 0, result.output
    cost = orjson.loads(result.stdout)
    plan = device_plan.plan_for_device(options.group_plan(), "cuda:0")
    assert cost["device_bytes"] == plan.total
    assert {m["role"]: m["kv_bytes"] for m in cost["devices"]} == {role: plan.bytes(role, "kv") for role in plan.roles}


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "deterministic"])
def test_the_plan_cascades_where_the_full_cache_does(invariant, cuda):
    """The planner's `cascade_shared` against `FullCache`'s choice for decode steps of `batch` problems' n candidates
    (the helper's heads, float32) over shared prefixes of whole blocks, the block from which the planner says they
    cascade and the one before, without and with --deterministic's per-problem rule, on a CPU and on (fake) CUDA, each
    by its own cost model."""
    import contextlib

    from kvrescue.engine import invariance
    from kvrescue.engine.caches import FullCache
    from kvrescue.shapes import token_kv_bytes
    from kvrescue_testkit.fake_cuda import FakeCuda

    invariance.enable(invariant)
    try:
        with FakeCuda() if cuda else contextlib.nullcontext():
            for batch, n in [(1, 8), (8, 8), (2, 4), (1, 2), (4, 3)]:
                start = memory_plan.cascade_shared(batch, n, invariant, cuda, token_kv_bytes(2, 128, 4), 1)
                first = -(-start // 16) * 16  # the first whole block count at or past `start`
                for shared in (s for s in (first - 16, first) if s > 0):
                    cache = FullCache(1, 2, 128, batch * (shared // 16 + 2 * n) + 8, max_rows=batch * (n + 1),
                                      max_row_tokens=shared + 32, block_size=16, device="cuda:0" if cuda else "cpu")
                    parents = [cache.create() for _ in range(batch)]
                    cache.begin(parents, [shared] * batch)
                    cache.end()
                    cache.begin([c for p in parents for c in cache.fork(p, n)], [1] * batch * n)
                    assert (cache.fwd.shared is not None) == (shared >= start), (batch, n, shared, start)
                    cache.end()
    finally:
        invariance.enable(False)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_plan_counts_flexattentions_block_mask_and_each_runners_step_lanes(graphs, monkeypatch):
    """On CUDA without flash-attn a full cache's decode step (and with CUDA graphs their pool) holds FlexAttention's
    block mask over the whole pool, not with --deterministic; every sampling runner keeps its step lanes. The bytes
    of each are `engine_bytes`' (checked against what the engine allocates in tests/test_engine_bytes.py)."""
    from kvrescue.cost import Architecture
    from kvrescue_testkit.paper_shapes import QWEN25_MATH_15B, QWEN25_MATH_7B

    archs = {"base": Architecture.from_config("base", QWEN25_MATH_7B),
             "helper": Architecture.from_config("helper", QWEN25_MATH_15B)}
    cell = memory_plan.CellShape(4, 8, "full", None, True, None, max_step_tokens=512, context_cap=4096,
                                 step_draws=32, detector_window=12)
    rows, pool_blocks = 4 * 8, engine_bytes.full_cache_tokens(4, 8, 512, 4096) // 16 + graphs

    def plans(mask: bool, invariant: bool = False, sampling: bool = True) -> dict[str, int]:
        with monkeypatch.context() as patch:
            if not mask:
                patch.setattr(memory_plan, "paged_mask_bytes", lambda rows, blocks: 0)
            if not sampling:
                patch.setattr(memory_plan, "sample_bytes", lambda rows, vocab: 0)
            plan = memory_plan.plan_cell(archs, cell, memory_plan.DeviceKind(cuda=True, dtype_bytes=2,
                                                                             cuda_graphs=graphs, invariant=invariant))
        return {p.what: p.bytes for p in plan.moments + plan.parts if p.role == "helper"}

    counted, without = plans(True), plans(False)
    mask = engine_bytes.paged_mask_bytes(rows, pool_blocks)
    step = "decode step of 32 candidates and its sampling"
    assert counted[step] - without[step] == mask
    if graphs:  # the pool holds the larger of a decode step (with its mask) and the sampling of the same bucket
        pool = "CUDA graph pool: a decode step or its sampling, each row bucket's logits"
        assert plans(True, sampling=False)[pool] - plans(False, sampling=False)[pool] == mask
        logits = 2 * rows * archs["helper"].args.vocab_size * 2
        assert counted[pool] - logits == max(plans(True, sampling=False)[pool] - logits,
                                             engine_bytes.sample_bytes(rows, archs["helper"].args.vocab_size))
    assert plans(True, invariant=True) == plans(False, invariant=True)  # --deterministic: SDPA, no mask
    lanes = "step lanes of 32 candidates: draws and detector state" + (", and the graphs' scratch lane" if graphs else "")
    assert counted[lanes] == engine_bytes.step_lanes_bytes(32 + graphs, 32, 12)


def test_the_plan_counts_the_prms_and_the_commits_static_forwards_on_cuda_with_graphs():
    """On CUDA with graphs on the PRM's cache holds a scratch block more, and its graphs' pool one scoring forward at
    the largest bucket: the candidates' rows (64: 4 problems x N 8 x base and helper) padded to 1,024 tokens (a
    512-token step and its tag), over 8,192 keys (the bucket of 257 blocks), in as many rows as SDPA's mask takes
    within SCORE_BYTES (2: 7 query heads a KV head x 1,024 x 8,192 x 2 bytes = 117 MB a row), and its buckets' two
    scores a row; the helper's pool a commit forward of its 4 problems' steps; none with --deterministic (eager) or
    without graphs."""
    from kvrescue.cost import Architecture
    from kvrescue_testkit.paper_shapes import PAPER_MODELS

    archs = {role: Architecture.from_config(role, {**shape, "model_type": "qwen2", **(
        {"architectures": ["Qwen2ForProcessRewardModel"]} if role == "prm" else {})})
        for role, shape in PAPER_MODELS.items()}
    cell = memory_plan.CellShape(4, 8, "bounded", 64, True, "prm", max_step_tokens=512, context_cap=4096)

    def parts(role: str = "prm", **kind) -> dict[str, int]:
        plan = memory_plan.plan_cell(archs, cell, memory_plan.DeviceKind(cuda=True, dtype_bytes=2, **kind))
        return {p.what: p.bytes for p in plan.parts if p.role == role}

    graphs, eager = parts(cuda_graphs=True), parts()
    assert parts(cuda_graphs=True, invariant=True) == eager
    (kv,) = [what for what in eager if what.startswith("PRM K/V")]
    pool = "CUDA graph pool: the PRM's scoring forward at its largest bucket, each bucket's outputs"
    assert set(graphs) - set(eager) == {pool, kv + " and the graphs' scratch block"}
    prm = memory_plan._role(archs["prm"], 1, False, 2)
    assert graphs[kv + " and the graphs' scratch block"] - eager[kv] == 16 * prm.kv_token
    forward = engine_bytes.forward_bytes(prm.args, 2, 2, 1024, engine_bytes.Keys("masked", 8192), "score",
                                         prm.vocab, True)
    assert graphs[pool] == forward + 2 * 2 * 2 * 2 * (1024).bit_length()  # 2 scores in bf16, rows and tokens buckets
    commit = "CUDA graph pool: a commit of 4 steps, each bucket's logits"
    assert commit in parts("helper", cuda_graphs=True) and commit not in parts("helper", cuda_graphs=True,
                                                                               invariant=True)
