"""A finished cell frees its caches, runners and controller by reference counting: the next cell of a grid must
not allocate on top of them (on a GPU nothing runs the cyclic collector between cells, so a reference cycle keeps
a cell's KV pools and CUDA-graph pools until some later full collection)."""

import gc
import types
import weakref

import orjson
import pytest
from rich.progress import Progress

from kvrescue import in_process
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache
from kvrescue.engine.prm import PRMScorer
from kvrescue.engine.runner import Runner
from kvrescue.engine.sampling import SamplingParams
from kvrescue.engine.scoring import HelperLoglik
from kvrescue.engine.steps import StepDecoder
from kvrescue.runs import run_grid
from kvrescue.search import Controller, SearchSettings
from tests.helpers import small_grid

TRACKED = (BoundedCache, FullCache, Runner, StepDecoder, PRMScorer, HelperLoglik, Controller)


@pytest.fixture()
def collector_off():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("scorer", ["prm", "helper-loglik"])
def test_a_finished_cell_of_a_grid_is_freed_without_the_cyclic_collector(collector_off, monkeypatch, scorer, qwen2_dir,
                                                                         llama_dir, prm_dir, tmp_path):
    problems = tmp_path / "tiny.jsonl"
    problems.write_bytes(b"".join(orjson.dumps({"question": f"What is {a} + 1?", "answer": str(a + 1)}) + b"\n"
                                  for a in range(2)))
    made: list[tuple[int, str, weakref.ref]] = []  # (cell, kind, object) of every tracked object built
    cell = [0]
    for kind in TRACKED:
        def init(self, *args, _init=kind.__init__, **kwargs):
            _init(self, *args, **kwargs)
            made.append((cell[0], type(self).__name__, weakref.ref(self)))
        monkeypatch.setattr(kind, "__init__", init)
    alive_at_start: list[list[str]] = []  # what earlier cells still hold when each cell starts
    decode = in_process.decode_cell

    def decode_one_cell(*args, **kwargs):
        alive_at_start.append([name for c, name, ref in made if c < cell[0] and ref() is not None])
        decode(*args, **kwargs)
        cell[0] += 1

    monkeypatch.setattr(in_process, "decode_cell", decode_one_cell)
    settings = SearchSettings(sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0), max_step_tokens=8,
                              max_steps=2, context_cap=256, batch=2)
    options = small_grid(tmp_path / "out", settings, benches=[str(problems)], methods=["kvrescue", "bon", "full", "helper"],
                         budgets=[16, 24], ns=[1], scorer=scorer,
                         models={"base": str(qwen2_dir), "helper": str(llama_dir), "prm": str(prm_dir)})
    results = run_grid(options, Progress(disable=True))
    assert len(results) == 6 and cell[0] == 6
    unused = HelperLoglik if scorer == "prm" else PRMScorer
    assert {name for _, name, _ in made} == {kind.__name__ for kind in TRACKED if kind is not unused}
    assert alive_at_start == [[]] * 6
    assert [name for _, name, ref in made if ref() is not None] == []
    assert in_cycles() == []


def in_cycles() -> list[str]:
    """kvrescue's objects and functions, and tensors, that only the cyclic collector would free now."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        names = [f"{o.__module__}.{o.__qualname__}" if isinstance(o, types.FunctionType)
                 else f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return [name for name in names if name.startswith(("kvrescue.", "torch."))]
