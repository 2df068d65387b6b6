"""The Runner's commits: a step every row adopted is committed by one static decode step where the runner has one."""

import numpy as np
import pytest
import torch

from kvrescue.engine import FullCache, load_model
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.runner import Runner


def _caches(net, kind: str):
    if kind == "full":
        return FullCache.for_model(net, 2048, max_rows=16, max_row_tokens=256, block_size=4)
    return BoundedCache.for_model(net, 16, "rkv", rows=8, max_append=64)


def _eager_and_static(model, kind: str) -> dict[str, Runner]:
    """Two runners over equal caches of `kind`: one eager, one with a static step (what CUDA graphs replay on a GPU,
    here eagerly)."""
    runners = {"eager": Runner(model, _caches(model.net, kind)), "static": Runner(model, _caches(model.net, kind))}
    runners["static"].static = StaticDecode(model.net, runners["static"].cache)  # before any row holds an entry
    return runners


@pytest.mark.parametrize("kind", ["full", "bounded"])
def test_a_commit_of_adopted_steps_is_one_static_step_with_the_eager_commits_logits(qwen2_dir, kind, monkeypatch):
    """Two problems each decode two candidates of 5 tokens, adopt one and commit its step: the runner with a static
    step (what CUDA graphs replay on a GPU, here eagerly) commits the last tokens through it, not through an eager
    forward, and keeps the logits and cache lengths the eager runner keeps."""
    model = load_model(qwen2_dir)
    runners = _eager_and_static(model, kind)
    generator = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7] * 7, [8, 9] * 6]
    steps = torch.randint(0, model.net.args.vocab_size, (5, 4), generator=generator)
    kept = {}
    for name, runner in runners.items():
        parents = runner.prefill(prompts)
        children = runner.fork_each(parents, 2)
        rows_t = torch.tensor(children)
        for t in range(4):  # the step's last token is not fed: the commit feeds it
            runner.decode(rows_t, children, steps[t])
        winners = [children[0], children[3]]
        for parent, child in zip(parents, winners):
            runner.adopt(parent, child)
        runner.release([c for c in children if c not in winners])
        if name == "static":
            monkeypatch.setattr(runner, "append", lambda *a, **k: pytest.fail("an eager forward for the commit"))
        columns = [0, 3]
        runner.commit(parents, [steps[:, c].tolist() for c in columns])
        kept[name] = runner.logits[torch.tensor(parents)]
        assert [runner.length(p) for p in parents] == [len(p) + 5 for p in prompts]
    torch.testing.assert_close(kept["static"], kept["eager"], atol=2e-5, rtol=1e-5)


def test_a_full_caches_commit_of_whole_steps_is_one_static_forward_with_the_eager_commits_logits(qwen2_dir,
                                                                                                monkeypatch):
    """The helper's commit of the base's winners: one row takes its whole step (7 tokens, past a partly filled
    block), another only the last token of the step it adopted: on a full cache with a static forward (what CUDA
    graphs replay on a GPU, here eagerly) one forward of 8 tokens a row (padding tokens) and 2 rows, not an eager
    one; the logits, lengths and keys of the eager runner."""
    model = load_model(qwen2_dir)
    runners = _eager_and_static(model, "full")
    generator = torch.Generator().manual_seed(4)
    prompts = [[5, 6, 7] * 7, [8, 9] * 5]
    steps = torch.randint(0, model.net.args.vocab_size, (7, 2), generator=generator)
    kept = {}
    for name, runner in runners.items():
        parents = runner.prefill(prompts)
        (child,) = runner.fork_each(parents[1:], 1)
        for t in range(6):
            runner.decode(torch.tensor([child]), [child], steps[t, 1:])
        runner.adopt(parents[1], child)
        if name == "static":
            monkeypatch.setattr(runner, "append", lambda *a, **k: pytest.fail("an eager forward for the commit"))
        runner.commit(parents, [steps[:, 0].tolist(), steps[:, 1].tolist()])
        kept[name] = runner.logits[torch.tensor(parents)]
        assert [runner.length(p) for p in parents] == [len(p) + 7 for p in prompts]
    torch.testing.assert_close(kept["static"], kept["eager"], atol=2e-5, rtol=1e-5)
    assert set(runners["static"].static.steps) >= {(2, 8, 8)}  # 2 rows, 8 blocks of 4 tokens, 8 tokens a row
    caches = {name: runner.cache for name, runner in runners.items()}
    for row in range(2):
        keys = {name: cache.k[:, cache.blocks(row)].flatten(1, 2)[:, : cache.length(row)]
                for name, cache in caches.items()}
        torch.testing.assert_close(keys["static"], keys["eager"])
