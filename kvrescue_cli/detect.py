"""Online degeneration detector for base candidates (DESIGN section 4).

Fed one generated token at a time (its text and the full-vocabulary entropy of the distribution it
was sampled from), it fires at the first eligible position where the mean entropy of the last
tokens is too high (incoherence) or the recent text compresses too well (looping). It also keeps
the extreme values seen at eligible positions, so thresholds can be calibrated from traces: a
threshold tau would have fired on a candidate exactly when ``max_mean_entropy > tau`` (or
``min_ratio < tau``).

`Detector` is the per-token definition. The decode loop (`engine.steps.StepDecoder`) runs the same
tests for all rows at once: the entropy window on the device, the gzip test on the host only for rows
that may hold `cmp_chars` characters; every token is screened, a step's last one too. tests/test_engine_steps.py
checks the two against each other.

Cost: one gzip of ``cmp_chars`` characters per token once the text is that long: about 40-55 us
per token on one CPU core (benchmarks/evict_bench.py); a few us before that.
"""

from __future__ import annotations

import gzip
from collections import deque
from dataclasses import dataclass

ENTROPY = "entropy"
REPETITION = "repetition"


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds and windows, with the paper's defaults."""

    tau_ent: float = 7.0      # fire when the mean entropy (nats) of the window exceeds this
    ent_window: int = 12      # tokens averaged
    min_tokens: int = 24      # entropy is checked only once this many tokens were generated
    tau_cmp: float = 0.18     # fire when the gzip ratio of the last cmp_chars drops under this
    cmp_chars: int = 800      # characters compressed (checked once the text is this long)
    gzip_level: int = 9


def gzip_ratio(text: str, level: int = 9) -> float:
    """len(gzip(text)) / len(text) in UTF-8 bytes, with a fixed header (mtime 0)."""
    raw = text.encode("utf-8")
    return len(gzip.compress(raw, compresslevel=level, mtime=0)) / len(raw)


class Detector:
    """Degeneration state of one candidate.

    ``update`` returns None, or the reason it fired (``"entropy"`` or ``"repetition"``; entropy is
    reported when both hold at the same token). Once fired it stays fired and ignores further tokens.
    """

    def __init__(self, config: DetectorConfig = DetectorConfig()) -> None:
        self.config = config
        self.tokens = 0                           # tokens seen
        self.fired: str | None = None
        self.fired_at: int | None = None          # 1-based index of the token it fired on
        self.max_mean_entropy: float | None = None  # over positions where entropy was checked
        self.min_ratio: float | None = None         # over positions where the ratio was checked
        self._entropies: deque[float] = deque(maxlen=config.ent_window)
        self._chars = 0
        self._tail = ""
        self._ratio: float | None = None          # ratio of the current tail (reused if unchanged)

    def update(self, text: str, entropy: float) -> str | None:
        """Account for one generated token; return the reason if the candidate degenerated."""
        if self.fired is not None:
            return self.fired
        cfg = self.config
        self.tokens += 1
        self._entropies.append(float(entropy))
        reason = None

        if self.tokens >= cfg.min_tokens:
            mean = sum(self._entropies) / len(self._entropies)
            if self.max_mean_entropy is None or mean > self.max_mean_entropy:
                self.max_mean_entropy = mean
            if mean > cfg.tau_ent:
                reason = ENTROPY

        if text:  # an empty piece leaves the window, and so its ratio, unchanged
            self._chars += len(text)
            self._tail = (self._tail + text)[-cfg.cmp_chars:]
            self._ratio = gzip_ratio(self._tail, cfg.gzip_level) if self._chars >= cfg.cmp_chars else None
        if self._ratio is not None:
            if self.min_ratio is None or self._ratio < self.min_ratio:
                self.min_ratio = self._ratio
            if reason is None and self._ratio < cfg.tau_cmp:
                reason = REPETITION

        if reason is not None:
            self.fired, self.fired_at = reason, self.tokens
        return reason
