"""A decode iteration's sampling, step ends and detector in static shapes (`step_graphs`): the same traces as the
unpadded iteration on the CPU (eagerly, over the padded buckets a GPU captures)."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvrescue.engine.invariance as invariance
import kvrescue_testkit.dry_run as dry

from kvrescue.detect import DetectorConfig
from kvrescue.engine import FullCache, load_model
from kvrescue.engine import streams as model_streams
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.runner import Runner
from kvrescue.engine.sampling import SamplingParams
from kvrescue.engine.step_graphs import StaticIterations
from kvrescue.engine import step_table as step_table_module
from kvrescue.engine.step_table import StepTable
from kvrescue.engine.steps import StepDecoder, StepRules
from kvrescue.engine.streams import ModelStream
from kvrescue_testkit.dry_run import TokenScript, fake_model
from kvrescue_testkit.fake_cuda import FakeCuda
from kvrescue_testkit.paper_shapes import SMALL, SMALL_MODELS
from kvrescue_testkit.random_checkpoints import build_tokenizer

# Tuned on step_qwen2_dir: its steps end at the delimiter, EOS and the cap, and screened rows fire both tests.
DETECTOR = DetectorConfig(tau_ent=5.85, ent_window=4, min_tokens=6, tau_cmp=1.2, cmp_chars=40)
RULES = dict(sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0), max_step_tokens=24, detector=DETECTOR)


def _runners(model, kind: str, static: bool) -> list[Runner]:
    """bon: a bounded cache; full: a full cache; kvrescue: both, advanced together."""
    caches = {"bon": [BoundedCache.for_model(model.net, 16, "rkv", rows=160, max_append=64)],
              "full": [FullCache.for_model(model.net, 16384, max_rows=160, block_size=8)]}
    caches["kvrescue"] = caches["bon"] + caches["full"]
    return [Runner(model, cache, static_sampling=static) for cache in caches[kind]]


def _traces(model, kind: str, static: bool) -> list[list[tuple]]:
    """Each runner's finished steps (row, tokens, entropies, finish, detector extremes and firing position), the
    runners prepared together before each advances (as the controller does): 3 candidates of 2 prompts, then, mid-run,
    64 more (the lanes grow past their first 64), then 5 more: the live lanes go through several buckets as steps
    end. Two of three candidates are screened."""
    rules = StepRules(frozenset(model.eos_ids), **RULES)
    runners = _runners(model, kind, static)
    parents = [runner.prefill([model.tokenizer.encode("Step 1: Let x be"), [5, 6, 7, 8]]) for runner in runners]
    waves = {0: 3, 3: 32, 9: 5}  # iteration: candidates per prompt
    done = [[] for _ in runners]
    iteration = 0
    while iteration in waves or any(runner.busy for runner in runners):
        for r, runner in enumerate(runners):
            if iteration in waves:
                rows = runner.fork_each(parents[r], waves[iteration])
                keys = [(r, iteration, i, 0) for i in range(len(rows))]
                runner.start(rows, keys, [runner.length(row) for row in rows], [i % 3 != 2 for i in range(len(rows))],
                             rules)
            runner.prepare()
        for r, runner in enumerate(runners):
            done[r] += [(s.row, s.tokens, s.entropies, s.finish, s.max_mean_entropy, s.min_gzip_ratio, s.fired_at)
                        for s in runner.advance()]
        iteration += 1
    if static:  # padded: buckets of several sizes since the lanes grew
        assert all(len(r.steps.lanes.rows) == 128 and len(r.steps.static.buckets) >= 3 for r in runners)
    return [sorted(d) for d in done]


@pytest.mark.filterwarnings("ignore:.*checked on decoded text")
@pytest.mark.parametrize("exact", [True, False], ids=["table", "text"])
@pytest.mark.parametrize("kind", ["bon", "full", "kvrescue"])
def test_static_iterations_decode_the_unpadded_iterations_traces(step_qwen2_dir, kind, exact, monkeypatch) -> None:
    """Step ends from the token-id table, or (a tokenizer that can't be tabled) on decoded text for rows whose token
    holds a newline."""
    if not exact:
        monkeypatch.setattr(StepTable, "_concatenates", staticmethod(lambda *args: False))
        monkeypatch.setattr(step_table_module, "_TABLES", {})
    model = load_model(step_qwen2_dir)
    dynamic = _traces(model, kind, static=False)
    static = _traces(model, kind, static=True)
    assert static == dynamic
    finishes = {t[3] for runner in dynamic for t in runner}
    assert {"step", "eos", "length", "entropy", "repetition"} <= finishes, finishes
    assert all(len(runner) == 2 * (3 + 32 + 5) for runner in dynamic)


def test_static_iterations_under_deterministic_decode_the_unpadded_iterations_traces(step_qwen2_dir) -> None:
    """With batch invariance on (`--deterministic`: the entropy's sums in fixed chunks), the padded buckets decode
    the unpadded iterations' traces too."""
    invariance.enable(True)  # conftest turns it off after every test
    model = load_model(step_qwen2_dir)
    assert _traces(model, "kvrescue", static=True) == _traces(model, "kvrescue", static=False)


class Dispatched(TorchDispatchMode):
    """How many aten ops were dispatched (not the device guards' `prim.device` queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.namespace == "aten"
        return func(*args, **(kwargs or {}))


def test_fake_cuda_cells_capture_each_runners_sampling_and_replay_it_with_almost_no_ops(monkeypatch):
    """Dry runs of bon, kvrescue and full on fake CUDA (stream order checked) with CUDA graphs: every sampling
    runner captures its iterations (per bucket of live lanes) and replays them; an iteration launched over a graph
    captured already dispatches a handful of ops (its inputs' one copy up, a view of its rows, the copy to the host), where
    the same iteration dispatched op by op takes dozens."""
    monkeypatch.setattr(model_streams, "_STREAMS", {})  # made afresh on this fake device
    roles, launches, iterations, captures = {}, Counter(), [], Counter()
    build_cell, launch, iterate = dry.build_cell, StepDecoder.launch, StepDecoder._iterate

    def recording_build(*args, **kwargs):
        engine = build_cell(*args, **kwargs)
        roles.update({id(runner): role for role, runner in engine.runners.items()})
        return engine

    def counted_launch(decoder, runner):
        idle, captured = decoder.pending is None and decoder.busy, sum(captures.values())
        with Dispatched() as dispatched:
            launch(decoder, runner)
        if idle:  # an iteration launched
            role = roles[id(runner)]
            if decoder.static is not None and decoder.static.graphs and sum(captures.values()) == captured:
                launches[role, "replayed"] += 1
                launches["most ops replayed"] = max(launches["most ops replayed"], dispatched.ops)
            else:
                launches[role, "captured or eager"] += 1

    def counted_iterate(decoder, runner, inputs, detect=True):
        with Dispatched() as dispatched:
            out = iterate(decoder, runner, inputs, detect)
        iterations.append(dispatched.ops)
        return out

    monkeypatch.setattr(dry, "build_cell", recording_build)
    monkeypatch.setattr(StepDecoder, "launch", counted_launch)
    monkeypatch.setattr(StepDecoder, "_iterate", counted_iterate)
    capture = StaticIterations._capture
    monkeypatch.setattr(StaticIterations, "_capture",
                        lambda self, iterate, runner, inputs: captures.update([roles[id(runner)]])
                        or capture(self, iterate, runner, inputs))
    run = dry.dry_run(("bon", "kvrescue", "full"), n=4, batch=2, synthetic=(4, 2), models=SMALL_MODELS)
    assert [c.steps for c in run.cells] == [4, 4, 4]
    assert set(captures) == {"base", "helper"}
    for role in captures:
        assert launches[role, "replayed"] > launches[role, "captured or eager"] > 0
    assert launches["most ops replayed"] <= 6 < 30 <= min(iterations)


def test_the_sampling_graphs_are_captured_again_when_the_lanes_or_the_kept_logits_move(monkeypatch):
    """On fake CUDA: 3 candidates (bucket 4 captured), then 70 more (the lanes grow past 64, the runner's logits past
    its 64 rows: both reallocated), then 3 again once those ended: bucket 4 is captured again, over the tensors of
    now (a graph replayed over the old ones would sample from freed memory)."""
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    captured = []
    capture = StaticIterations._capture
    monkeypatch.setattr(StaticIterations, "_capture", lambda self, iterate, runner, inputs: captured.append(
        inputs.shape[1]) or capture(self, iterate, runner, inputs))
    tokenizer = build_tokenizer(512)
    rules = StepRules(frozenset(), SamplingParams(), max_step_tokens=8, fixed_length=3)
    with FakeCuda(host_reads=TokenScript(tokenizer.encode(" x", add_special_tokens=False)[0])):
        model = fake_model(SMALL, "base", tokenizer, torch.bfloat16, "cuda:0")
        runner = Runner(model, FullCache.for_model(model.net, 4096, max_rows=160, max_row_tokens=64), cuda_graphs=True,
                        stream=ModelStream.of(model.device, "base"))
        (parent,) = runner.prefill([[5, 6, 7]])
        for count in (3, 70, 3):
            rows = runner.fork(parent, count)
            runner.start(rows, [(0, count, i, 0) for i in range(count)], [3] * count, [False] * count, rules)
            while runner.busy:
                runner.prepare()
                runner.advance()
            runner.release(rows)
        static = runner.steps.static
        assert static.reads[0] is runner.steps.lanes.draws and static.reads[1] is runner.logits
    assert captured == [4, 128, 4]
