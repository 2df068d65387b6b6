"""The decode path never waits for the device but once per iteration (the packed tokens / finish codes).

On the CPU nothing waits, so the operations that would synchronise on a GPU are counted instead, under a
TorchDispatchMode: scalar reads (`_local_scalar_dense`: .item(), bool(t)), `nonzero`, `masked_select` and
boolean-mask indexing (their output size is only known on the device), plus, patched for the count, the
tensor methods that copy to the host (.cpu(), .tolist()) and `torch.tensor(..., device=...)`, a copy from
pageable memory that drains the device's queue first (uploads go through `transfer.upload`).
"""

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvrescue.detect import DetectorConfig
from kvrescue.engine import FullCache, load_model
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.runner import Runner
from kvrescue.engine.sampling import SamplingParams
from kvrescue.engine.steps import StepRules
from kvrescue.shapes import ALWAYS_CASCADE

aten = torch.ops.aten
SIZE_ON_DEVICE = (aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default)
INDEXING = (aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_)


class SyncCounter(TorchDispatchMode):
    """Counts, by name, the operations that make the host wait for a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SIZE_ON_DEVICE:
            self.counts[str(func)] += 1
        elif func.overloadpacket in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.counts[f"{func} by a boolean mask"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch):
    """A SyncCounter also counting copies to the host and blocking uploads while the block runs."""
    counter = SyncCounter()

    def counted(name, method):
        def wrapper(*args, **kwargs):
            if name != "torch.tensor" or kwargs.get("device") is not None:
                counter.counts[name] += 1
            return method(*args, **kwargs)
        return wrapper

    with monkeypatch.context() as patch:
        for name in ("cpu", "tolist"):
            patch.setattr(torch.Tensor, name, counted(f"Tensor.{name}", getattr(torch.Tensor, name)))
        patch.setattr(torch, "tensor", counted("torch.tensor", torch.tensor))
        with counter:
            yield counter.counts


def _runner(model, kind: str) -> Runner:
    if kind == "full":  # cascade on: the candidates' shared prefixes are read in a separate pass
        return Runner(model, FullCache.for_model(model.net, 1 << 15, max_rows=64, block_size=8, cascade=ALWAYS_CASCADE))
    evictor = "h2o" if kind == "bounded-h2o" else "rkv"  # h2o: its received attention accumulated every step
    return Runner(model, BoundedCache.for_model(model.net, 16, evictor, rows=8, max_append=64))  # compresses as it goes


@pytest.mark.parametrize("prepared", [False, True], ids=["advanced", "prepared"])  # `prepare` launches the sampling
@pytest.mark.parametrize("kind", ["full", "bounded", "bounded-h2o"])
def test_one_host_transfer_per_iteration_and_no_other_sync(qwen2_dir, kind, prepared, monkeypatch) -> None:
    model = load_model(qwen2_dir)
    runner = _runner(model, kind)
    with counting(monkeypatch) as counts:
        parents = runner.prefill([[5, 6, 7] * 9, [8, 9] * 11])  # uneven: padded prefill
        rows = [child for parent in parents for child in runner.fork(parent, 4)]
    assert counts == {}
    # Steps long enough for the bounded rows to be compressed (at 16 + 128 entries) while decoding;
    # the detector screens every row, its text test included (a low cmp_chars).
    rules = StepRules(frozenset(model.eos_ids), SamplingParams(), fixed_length=140,
                      detector=DetectorConfig(cmp_chars=40, tau_cmp=0.0, tau_ent=1e9))
    runner.start(rows, [(0, i, 0, 0) for i in range(len(rows))], [27] * len(rows), [True] * len(rows), rules)
    iterations = 0
    while runner.busy:
        with counting(monkeypatch) as counts:
            if prepared:
                runner.prepare()
            done = runner.advance()
        iterations += 1
        assert counts == {"Tensor.cpu": 1}, f"iteration {iterations}: {dict(counts)}"
    assert iterations == 140 and len(done) == len(rows)
    if kind != "full":
        assert max(runner.cache.peak_length(r) for r in rows) == 16 + 128  # compression ran inside the loop
    winners = [done[0], done[4]]
    runner.adopt(parents[0], winners[0].row)
    runner.release([s.row for s in done if s.row not in (winners[0].row,)])
    with counting(monkeypatch) as counts:
        runner.commit(parents, [w.tokens for w in winners])
    assert counts == {}


def test_the_counter_sees_what_would_wait(monkeypatch) -> None:
    x = torch.arange(6)
    with counting(monkeypatch) as counts:
        x[x > 2]
        x.nonzero()
        x[0].item()
        x.cpu()
        x.tolist()
        torch.tensor([1], device="cpu")
        torch.tensor([1])  # host data, no device named: not an upload
        x.index_select(0, torch.arange(2))  # integer indices: stays on the device
    assert counts == {"aten.index.Tensor by a boolean mask": 1, "aten.nonzero.default": 1,
                      "aten._local_scalar_dense.default": 1, "Tensor.cpu": 1, "Tensor.tolist": 1, "torch.tensor": 1}
