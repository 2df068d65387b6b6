"""The settings the stepwise controller (`search.Controller`) decides with, torch-free: the grid and the CLI read
them before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrescue.detect import DetectorConfig
from kvrescue.sampling_params import SamplingParams
from kvrescue.shapes import MAX_CONTEXT, MAX_STEP_TOKENS, MAX_STEPS


@dataclass(frozen=True)
class SearchSettings:
    """The run's settings the controller decides with (a cell's method, N and seed come with the cell); defaults are
    the paper's. `batch`, problems in flight, has none here: the grid's (`run_options.DEFAULT_BATCH`) depends on the
    device."""

    sampling: SamplingParams = SamplingParams()
    detector: DetectorConfig = DetectorConfig()
    max_step_tokens: int = MAX_STEP_TOKENS
    max_steps: int = MAX_STEPS
    context_cap: int = MAX_CONTEXT
    batch: int = field(kw_only=True)
    synthetic_steps: tuple[int, int] | None = None  # (LEN, COUNT): steps end after LEN tokens, problems after COUNT steps

    @property
    def step_cap(self) -> int:
        return self.max_steps if self.synthetic_steps is None else self.synthetic_steps[1]
