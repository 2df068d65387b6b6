"""The sampling parameters a run decodes with (`engine/sampling.py` samples with them): their defaults, the paper's,
and their one-line refusal. No torch here: `kvrescue run` shows these defaults before anything is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-6  # below it (0 aside: greedy), logits / T can overflow float32: every probability NaN
MIN_TOP_P = 1e-6  # top_p 0 keeps no token (a smaller one rounds to 0 in float32)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 20

    def refusal(self) -> str | None:
        """Why these parameters cannot sample (every probability zero or NaN), as the options name them; or None."""
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            return (f"--temperature {self.temperature}: need 0 (greedy) or a finite temperature of at least "
                    f"{MIN_TEMPERATURE:g}")
        if not MIN_TOP_P <= self.top_p <= 1:
            return f"--top-p {self.top_p}: need {MIN_TOP_P:g} <= p <= 1 (0 would keep no token)"
        return None
