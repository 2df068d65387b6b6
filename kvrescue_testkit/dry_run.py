"""A dry run of `kvrescue run`'s decode code on fake CUDA (`fake_cuda`), at the paper's shapes, without a GPU.

The models are built from their configs through the loader's real model-building code (`loader.build_network`) with
fake weights, each tensor made when the loader reads it; the cells decode through `decoding.decode_cell` (the Controller, the
Runners, the caches, the PRM scorer, CUDA graphs) with the paper's settings but synthetic steps, so that a few
steps of a `bon` and a `kvrescue` cell run every CUDA-path forward (prefill, one-token decode as captured graphs,
multi-token commits, PRM scoring) in seconds. Device, dtype, shape and stride mistakes raise as on a GPU. The
sampled tokens, which a host read of a fake tensor cannot give, come from a script (`TokenScript`).

`dry_run(...)` returns each cell's peak bytes per device and the bytes of each part (the engine module that
allocated them; the weights by role) alive at that peak, for comparison with a memory planner.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrescue.cell_plan import Cell
from kvrescue.data import Problem, ProblemSet
from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue.engine.loader import DTYPES, LoadedModel, build_network
from kvrescue_testkit.fake_cuda import FakeCuda, HostReads, peaks
from kvrescue.grid import GridOptions, grid_options
from kvrescue_testkit.paper_shapes import PAPER_MODELS, hf_config
from kvrescue_testkit.random_checkpoints import build_tokenizer
from kvrescue.search import SearchSettings


class TokenScript(HostReads):
    """Host reads in a dry run: every token the decode loop reads back (row 0 of its one packed float64 [5, rows]
    transfer per iteration, `steps.StepDecoder.advance`) is `token`; every other read is zeros (finish codes 0: the
    synthetic steps end by their length; PRM scores 0: ties, the first candidate wins)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def values(self, tensor: torch.Tensor) -> np.ndarray:
        values = super().values(tensor)
        if tensor.dtype == torch.float64 and tensor.dim() == 2 and tensor.shape[0] == 5:
            values[0] = self.token
        return values


class FakeWeights(Mapping):
    """A checkpoint's tensors by Hugging Face name, each an uninitialised (fake) tensor made when it is read, as the
    loader reads safetensors slices one at a time."""

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, device: str) -> None:
        self.shapes, self.dtype, self.device = shapes, dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def checkpoint_shapes(shape: dict, prm: bool) -> dict[str, torch.Size]:
    """Tensor names and shapes of a Qwen2 checkpoint of `shape` (with the PRM's score head for `prm`), read from
    transformers' Qwen2 built on the meta device (no memory)."""
    from transformers import Qwen2ForCausalLM, Qwen2Model

    config = hf_config(shape)
    with torch.device("meta"):
        if not prm:
            return {name: t.shape for name, t in Qwen2ForCausalLM(config).state_dict().items()}
        shapes = {f"model.{name}": t.shape for name, t in Qwen2Model(config).state_dict().items()}
    h = shape["hidden_size"]
    return {**shapes, "score.0.weight": torch.Size([h, h]), "score.0.bias": torch.Size([h]),
            "score.2.weight": torch.Size([2, h]), "score.2.bias": torch.Size([2])}


def fake_model(shape: dict, role: str, tokenizer, dtype: torch.dtype, device: str) -> LoadedModel:
    """A model of `shape` (a PRM for role "prm") with fake weights on `device`, built by the loader's
    `build_network`. Call it inside `FakeCuda`."""
    prm = role == "prm"
    config = {**hf_config(shape, tokenizer).to_dict(), "model_type": "qwen2",
              **({"architectures": ["Qwen2ForProcessRewardModel"]} if prm else {})}
    net = build_network(FakeWeights(checkpoint_shapes(shape, prm), dtype, device), config, dtype, device)
    return LoadedModel(net, tokenizer, config, f"fake-{role}", [tokenizer.eos_token_id])


@dataclass
class DryRunCell:
    """What one cell of a dry run did and allocated."""

    method: str
    problems: int
    steps: int  # committed steps over all problems
    syncs: int  # host reads of device tensors and synchronisations
    graph_replays: int
    memory: dict[str, dict[str, Any]]  # `fake_cuda.peaks`: per device, peak bytes and the parts alive then
    live_after: dict[str, int] = field(default_factory=dict)  # bytes per device the cell left alive (no gc run)


@dataclass
class DryRun:
    """A dry run's cells and the weights' bytes per role."""

    weights: dict[str, int]
    cells: list[DryRunCell]


def dry_run(methods: tuple[str, ...] = ("bon", "kvrescue"), *, n: int = 8, budget: int = 64, batch: int = 64,
            synthetic: tuple[int, int] = (4, 2), max_step_tokens: int = 512, context_cap: int = 4096,
            cuda_graphs: bool = True, dtype: str = "bfloat16", models: Mapping[str, dict] = PAPER_MODELS,
            memory_gib: float = 139.8, device: str = "cuda:0") -> DryRun:
    """Decode `batch` synthetic problems of each method (steps of synthetic[0] tokens, synthetic[1] steps each) on
    one fake CUDA device with fake-weight models of `models`' shapes, at the paper's sampling and caps. Raises what
    the CUDA path raises."""
    tokenizer = build_tokenizer(512)
    token = tokenizer.encode(" x", add_special_tokens=False)[0]
    torch_dtype = DTYPES[dtype]
    with FakeCuda(memory_gib=memory_gib, host_reads=TokenScript(token)) as cuda:
        loaded: dict[str, LoadedModel] = {}
        weights: dict[str, int] = {}
        for role, shape in models.items():
            before = cuda.memory.device_live[device]
            with cuda.memory.labelled(f"weights.{role}"):
                loaded[role] = fake_model(shape, role, tokenizer, torch_dtype, device)
            weights[role] = cuda.memory.device_live[device] - before
        problems = [Problem(i, f"What is {i} + {2 * i}? Let x be the answer.", str(3 * i), {}) for i in range(batch)]
        problem_set = ProblemSet("synthetic", "generic", "dry-run", problems)
        settings = SearchSettings(batch=batch, synthetic_steps=synthetic, max_step_tokens=max_step_tokens,
                                  context_cap=context_cap)
        options = grid_options({role: f"fake-{role}" for role in models}, settings, Path("unused"),
                               benches=["synthetic"], methods=list(methods), budgets=[budget], ns=[n], seeds=[0],
                               evictor="rkv", devices=(device,), dtype=dtype, cuda_graphs=cuda_graphs)
        cells = []
        for method in methods:
            cells.append(_cell(cuda, options, Cell(problem_set, method, budget, n, 0), loaded))
        return DryRun(weights, cells)


def _cell(cuda: FakeCuda, options: GridOptions, cell: Cell, models: dict[str, LoadedModel]) -> DryRunCell:
    """Decode one cell with the cyclic garbage collector off, so that what it leaves alive is what reference
    counting does not free."""
    gc.collect()
    cuda.memory.reset_peaks()
    before, syncs, replays = dict(cuda.memory.device_live), cuda.syncs, cuda.graph_replays
    traces: list = []
    gc.disable()
    try:
        plan = replace(options, methods=[cell.method]).plan_of(cell)
        decode_cell(plan, cell, build_cell(plan, models), iter(cell.problems.problems),
                    lambda trace, _: traces.append(trace))
        left = {d: b - before.get(d, 0) for d, b in cuda.memory.device_live.items() if b - before.get(d, 0)}
    finally:
        gc.enable()
    return DryRunCell(cell.method, len(traces), sum(t.n_steps for t in traces), cuda.syncs - syncs,
                      cuda.graph_replays - replays, peaks(cuda.memory), left)
