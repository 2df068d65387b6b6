"""What `kvrescue run` may be asked for, one small dataclass per concern: a grid's axes (`GridAxes`), where its
problems come from and its folders go (`RunIO`), its devices (`Placement`), how the engine computes
(`EngineOptions`), its models and their inputs (`ModelOptions`), its graders (`GradingOptions`). Each holds its
defaults (the CLI shows these; `grid.GridOptions` is their union with the axes, the evictor and the search
settings) and checks what it alone can.

No torch here: the CLI reads the defaults before anything is loaded. What needs the engine's registries (the evictors,
the PRM recipes) is checked where the cell plans are built (`grid.GridOptions.check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvrescue.devices import CPU, GPU, device_groups
from kvrescue.dtypes import NAMES as DTYPE_NAMES
from kvrescue.errors import InputError
from kvrescue.grading import check_grader
from kvrescue.prompts import PROMPT_STYLES
from kvrescue.scorers import PRM, SCORERS
from kvrescue.shapes import BUFFER

ENGINES = ("native", "vllm")
AUTO = "auto"  # the CLI's default for what `run` resolves: --prompt, --prm-recipe, --dtype (and --devices, --batch)
DEFAULT_BATCH = {CPU: 4, GPU: 64}  # --batch unless auto (a GPU's default, except on a Ray cluster)


@dataclass(frozen=True)
class GridAxes:
    """One grid's axes: its cells are their product."""

    benches: list[str]
    methods: list[str]
    budgets: list[int]
    ns: list[int]
    seeds: list[int]

    def union(self, other: GridAxes) -> GridAxes:
        """Every value of either, in order of first appearance."""
        return GridAxes(*(list(dict.fromkeys([*a, *b])) for a, b in zip(vars(self).values(), vars(other).values())))


@dataclass(frozen=True, kw_only=True)
class RunIO:
    """Where the problems come from and the run folders go."""

    out: Path  # the root of the run folders
    limit: int | None = None  # the first K problems of each bench
    data_dir: Path | None = None
    problem_field: str | None = None
    answer_field: str | None = None
    overwrite: bool = False
    shard: tuple[int, int] | None = None  # (i, k): every k-th problem from the i-th

    def check(self) -> None:
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise InputError(f"--shard {self.shard[0]}/{self.shard[1]}: need 0 <= i < k")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which devices decode, in groups of `tp`."""

    devices: tuple[str, ...] = ("cpu",)  # one device decodes in this process; more, one Ray actor per group
    ray_address: str | None = None  # a Ray cluster to run the actors on (else a private local instance)
    tp: int = 1  # devices per group: every model is sharded over a group's K devices (rank_group.py)
    device_memory: int | None = None  # --device-memory: each device's bytes, for the plan, in place of its free memory

    def groups(self) -> list[tuple[str, ...]]:
        """The device groups, one worker each (`devices.device_groups`: one-line errors for devices `tp` can't
        group)."""
        return device_groups(self.devices, self.tp)

    def check(self) -> None:
        self.groups()


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How the engine computes."""

    engine: str = "native"  # vllm: the full-context roles on vLLM (vllm_roles), the rest on this engine
    vllm_memory: float = 0.4  # with engine vllm: vLLM's share of the device (of RAM on a CPU)
    dtype: str = "float32"
    cuda_graphs: bool = True  # the one-token decode steps (evicted base, helper, full) as CUDA graphs (on a GPU)
    deterministic: bool = False  # batch-invariant kernels (engine/invariance.py, docs/reproducibility.md)
    buffer: int = BUFFER  # W: entries an evicted row appends past the budget before a compression (B' = B + W)
    batch_auto: bool = False  # settings.batch was chosen by --batch auto (the largest that fits)

    def check(self) -> None:
        if self.buffer < 1:
            raise InputError(f"--buffer {self.buffer}: need at least 1 entry past the budget (B' = B + W)")
        if self.dtype not in DTYPE_NAMES:
            raise InputError(f"unknown --dtype '{self.dtype}': use one of {', '.join(DTYPE_NAMES)} or auto")
        if self.engine not in ENGINES:
            raise InputError(f"--engine {self.engine!r}: expected {' or '.join(ENGINES)}")
        if not 0 < self.vllm_memory < 1:
            raise InputError(f"--vllm-memory {self.vllm_memory}: expected a share of the device between 0 and 1")


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The models by role, and what they read: the prompt style, the scorer, a PRM's recipe and input format."""

    models: dict[str, str]  # by role: base, helper, prm (a PRM scorer's)
    scorer: str  # scorers.SCORERS
    revisions: dict[str, str] = field(default_factory=dict)  # --base-revision and the others: a role's Hub revision
    prompt: str = "math"  # the prompt style (prompts.PROMPT_STYLES; `auto` resolved by `auto_options.resolve_prompt`)
    prm_recipe: str = "qwen-math"  # the PRM's recipe (engine/prm_recipes; `auto` resolved by `resolve_prm_recipe`)
    prm_format: str = "paper"  # the qwen-math recipe's input format (engine/prm_recipes/qwen_math.py)

    def hub_revisions(self) -> dict[str, str]:
        """{Hub id: revision} of the grid's roles given a revision (`hub.pin`)."""
        return {self.models[role]: revision for role, revision in self.revisions.items() if role in self.models}

    def check(self) -> None:
        if self.scorer not in SCORERS:
            raise InputError(f"unknown scorer '{self.scorer}': use a PRM, or one of {', '.join(SCORERS[1:])}")
        if self.prompt not in PROMPT_STYLES:
            raise InputError(f"unknown --prompt '{self.prompt}': use one of {', '.join(PROMPT_STYLES)}")


@dataclass(frozen=True, kw_only=True)
class GradingOptions:
    """Which grader decides `correct`, and which others the traces record."""

    grader: str = "qwen"  # grader.GRADERS
    also_grade: tuple[str, ...] = ()

    def check(self) -> None:
        for grader in (self.grader, *self.also_grade):
            check_grader(grader, "--also-grade" if grader != self.grader else "--grader")


CONCERNS = (RunIO, Placement, EngineOptions, ModelOptions, GradingOptions)


def parse_shard(value: str | None) -> tuple[int, int] | None:
    """--shard i/k as (i, k) (`RunIO.check` refuses all but 0 <= i < k); a one-line error for another form."""
    if value is None:
        return None
    parts = value.split("/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise InputError(f"--shard {value!r}: expected i/k with 0 <= i < k, e.g. 0/4")
    return int(parts[0]), int(parts[1])


def split_scorer(models: dict[str, str]) -> tuple[dict[str, str], str]:
    """--prm names a PRM checkpoint, or the named alternative scorer (`--prm helper-loglik`): the grid's models (no
    `prm` role for the alternative) and its scorer (`scorers.SCORERS`)."""
    if models.get("prm") in SCORERS[1:]:
        return {role: model for role, model in models.items() if role != "prm"}, models["prm"]
    return models, PRM
