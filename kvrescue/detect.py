"""Online degeneration detector for base candidates (DESIGN section 4): its settings and the gzip ratio.

The detector fires at the first eligible position where the mean entropy of the last tokens is too high
(incoherence) or the recent text compresses too well (looping); entropy is reported when both hold at the same
token. It keeps the extreme values seen at eligible positions, so thresholds can be calibrated from traces: a
threshold tau would have fired on a candidate exactly when ``max_mean_entropy > tau`` (or ``min_gzip_ratio < tau``).

The rules run in one place, the decode loop (`engine.steps.StepDecoder`), for all rows at once: the entropy
window on the device, the gzip test on the host only for rows that may hold `cmp_chars` characters; every token
is screened, a step's last one too. tests/oracles.py transcribes the rules token by token, and
tests/engine/test_steps.py checks the decode loop against it.

Cost: one gzip of ``cmp_chars`` characters per token once the text is that long (docs/benchmarks.md); no host
work per token before that.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds and windows, with the paper's defaults."""

    tau_ent: float = 7.0      # fire when the mean entropy (nats) of the window exceeds this
    ent_window: int = 12      # tokens averaged
    min_tokens: int = 24      # entropy is checked only once this many tokens were generated
    tau_cmp: float = 0.18     # fire when the gzip ratio of the last cmp_chars drops under this
    cmp_chars: int = 800      # characters compressed (checked once the text is this long)
    gzip_level: int = 9

    def refusal(self) -> str | None:
        """Why these thresholds cannot run (a NaN or infinite one: it would never fire, and JSON records it as
        null), as the options name them; or None."""
        for option, value in (("--tau-ent", self.tau_ent), ("--tau-cmp", self.tau_cmp)):
            if not math.isfinite(value):
                return f"{option} {value}: need a finite threshold"
        return None


def gzip_ratio(text: str, level: int = 9) -> float:
    """len(gzip(text)) / len(text) in UTF-8 bytes, with a fixed header (mtime 0)."""
    raw = text.encode("utf-8")
    return len(gzip.compress(raw, compresslevel=level, mtime=0)) / len(raw)
