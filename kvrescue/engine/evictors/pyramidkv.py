"""PyramidKV (Cai et al. 2024) at decode time: SnapKV scores, per-layer budgets shrinking with depth."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvrescue.engine.evictors.snapkv import SnapKV
from kvrescue.evictor_catalogue import PyramidKVSettings
from kvrescue.shapes import OBSERVATION_WINDOW


@dataclass(frozen=True)
class PyramidKV(PyramidKVSettings, SnapKV):
    """PyramidKV (Cai et al. 2024) at decode time: SnapKV scores, the layers' budgets a pyramid shrinking with depth.
    kvpress's `PyramidKVPress.get_layer_budget` over the past positions of a compression from B', the window on top
    (as the authors' code adds it): past budgets with a mean of B - OBSERVATION_WINDOW run linearly from the first
    layer's most to the last's fewest, (B - OBSERVATION_WINDOW) / beta, the most capped so that no layer keeps more
    than B' - OBSERVATION_WINDOW entries. Exact fractions rounded half to even: the budgets sum to n_layers x B.
    Uniform where the last layer would keep under one past entry (kvpress asks fewest >= its window, which it counts
    inside the budget)."""

    def layer_budgets(self, n_layers: int, budget: int, trigger: int) -> list[int]:
        mean = Fraction(budget - OBSERVATION_WINDOW)  # max_capacity_prompt - window_size
        fewest = mean / self.beta
        most = 2 * mean - fewest
        room = trigger - 2 * OBSERVATION_WINDOW  # q_len - window_size over the past positions
        if most >= room:
            most, fewest = Fraction(room), 2 * mean - room
        if n_layers == 1 or not most >= fewest >= 1:
            return [budget] * n_layers
        step = (most - fewest) / (n_layers - 1)
        return [round(most - layer * step) + OBSERVATION_WINDOW for layer in range(n_layers)]
