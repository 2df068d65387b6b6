"""The executor without Ray: one device group decoding in this process (with `--tp K`, rank 0 of its K)."""

from __future__ import annotations

from typing import Callable

from kvrescue.cell_plan import Cell
from kvrescue.cell_runners import CellParts, build_cell
from kvrescue.data import Problem
from kvrescue.decoding import decode_cell
from kvrescue.device_plan import batch_description, device_memory, vllm_memory, vllm_specs, wait_for_room
from kvrescue.engine.prm_recipes import get_recipe
from kvrescue.grading import GradeFn
from kvrescue.grid import GridOptions
from kvrescue.group_models import check_policy_tokenizers, load_roles, use_device
from kvrescue.outputs import Trace
from kvrescue.rank_group import RankGroup, leading
from kvrescue.search import DecodeProgress
from kvrescue.vllm_engine.roles import VllmEngines


class InProcessGroup:
    """One device group decoding in this process, its models loaded once. `parts`, `grade`: what its cells are
    built and graded with (`cell_runners.CellParts`, grader.grade), for benchmarks that swap one."""

    def __init__(self, options: GridOptions, group: tuple[str, ...], parts: CellParts = CellParts(),
                 grade: GradeFn | None = None) -> None:
        self.options, self.group, self.parts, self.grade = options, group, parts, grade
        self.plan = plan = options.group_plan()
        self.ranks: RankGroup | None = None
        self.vllm: VllmEngines | None = None
        device = group[0]  # a device of --devices, named as this process sees it
        use_device(device)
        # One-line errors before any group forms or weights are read (a refusal inside a group would hang its ranks).
        shares = vllm_memory(plan, device, *device_memory(device, options.device_memory))
        if not shares:
            wait_for_room(plan, group)
        try:
            self.ranks = RankGroup(options, group) if len(group) > 1 else None
            self.models = load_roles(plan, device)
            if options.engine == "vllm":
                recipe = get_recipe(options.prm_recipe, options.prm_format)
                self.vllm = VllmEngines(vllm_specs(plan), options.dtype, recipe, shares,
                                        batch_invariant=options.deterministic)
                check_policy_tokenizers({**{role: m.tokenizer for role, m in self.models.items()},
                                         **{role: t for role, (t, _) in self.vllm.tokenizers.items()}})
        except BaseException:
            self.close()
            raise

    def decode_cell(self, cell: Cell, problems: list[Problem], emit: Callable[[Trace, int], None],
                    on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
        """Decode `problems` of `cell` here, emitting every problem's trace once (and running totals to
        `on_progress` every few seconds)."""
        if problems:
            plan = self.options.plan_of(cell)
            engine = build_cell(plan, self.models, self.vllm, self.parts)
            with leading(self.ranks, cell, problems) as problems:
                decode_cell(plan, cell, engine, problems, emit, on_progress,
                            **({"grade": self.grade} if self.grade else {}))

    def close(self) -> None:
        """Stop the group's other ranks and the vLLM engines, if any."""
        if self.ranks is not None:
            self.ranks.close()
        if self.vllm is not None:
            self.vllm.close()

    def describe(self) -> dict:
        """The executor, for config.json."""
        return {"kind": "in-process", "devices": list(self.group), **({"tp": self.options.tp} if self.ranks else {}),
                **batch_description(self.plan),
                **({"vllm_memory": self.options.vllm_memory} if self.vllm else {})}
