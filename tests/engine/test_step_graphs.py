"""A decode iteration's sampling, step ends and detector in static shapes (`step_graphs`): the same traces as the
unpadded iteration on the CPU (eagerly, over the padded buckets a GPU captures)."""

import pytest
import torch

from kvrescue.detect import DetectorConfig
from kvrescue.engine import FullCache, load_model
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.runner import Runner
from kvrescue.engine.sampling import SamplingParams
from kvrescue.engine.steps import StepRules

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


@pytest.mark.parametrize("kind", ["bon", "full", "kvrescue"])
def test_static_iterations_decode_the_unpadded_iterations_traces(step_qwen2_dir, kind) -> None:
    model = load_model(step_qwen2_dir)
    torch.manual_seed(0)
    dynamic = _traces(model, kind, static=False)
    static = _traces(model, kind, static=True)
    assert static == dynamic
    finishes = {t[3] for runner in dynamic for t in runner}
    assert {"step", "eos", "length", "entropy", "repetition"} <= finishes, finishes
    assert all(len(runner) == 2 * (3 + 32 + 5) for runner in dynamic)
