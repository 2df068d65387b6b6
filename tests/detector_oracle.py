"""The degeneration detector's rules (DESIGN section 4) transcribed token by token: the test oracle the decode
loop's vectorised detector (engine/steps.py) is checked against."""

from __future__ import annotations

from collections import deque

from kvrescue_cli.detect import DetectorConfig, gzip_ratio
from kvrescue_cli.reasons import ENTROPY, REPETITION


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
