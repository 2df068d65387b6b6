"""PyramidKV's per-layer budgets against kvpress's formula."""

from __future__ import annotations

import pytest

from kvrescue.engine.evictors.pyramidkv import PyramidKV
from kvrescue.shapes import OBSERVATION_WINDOW


def kvpress_layer_budget(q_len: int, window_size: int, compression_ratio: float, beta: int, num_layers: int,
                         layer_idx: int, least: float) -> int:
    """kvpress's `PyramidKVPress.get_layer_budget`, line by line (floats), its last check's lower bound `least` (kvpress:
    window_size, the window counted inside the budget)."""
    max_capacity_prompt = window_size + q_len * (1 - compression_ratio)
    min_num = (max_capacity_prompt - window_size) / beta
    max_num = (max_capacity_prompt - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
        max_num = q_len - window_size
        min_num = (max_capacity_prompt - window_size) * 2 - max_num
    if not (q_len >= max_num >= min_num >= least):
        return round(q_len * (1 - compression_ratio))
    steps = (max_num - min_num) / (num_layers - 1)
    return round(max_num - layer_idx * steps)


@pytest.mark.parametrize("layers,budget,trigger,beta", [
    (2, 16, 144, 2), (2, 16, 144, 20), (28, 64, 192, 20), (28, 512, 640, 20), (24, 128, 256, 5), (5, 100, 228, 3),
    (3, 512, 520, 20), (36, 2048, 2176, 20), (7, 33, 161, 1)])
def test_pyramidkv_budgets_are_kvpress_formula_over_the_past_with_the_window_on_top(layers, budget, trigger, beta):
    """A compression from B' = trigger: kvpress's query the B' - W past positions, its window W (no layer keeps more
    than B' - W), its kept mean B - W, at least one past entry each; the window added to every layer's."""
    w = OBSERVATION_WINDOW
    ratio = 1 - (budget - w) / (trigger - w)
    want = [kvpress_layer_budget(trigger - w, w, ratio, beta, layers, layer, least=1) + w for layer in range(layers)]
    got = PyramidKV(beta=beta).layer_budgets(layers, budget, trigger)
    assert got == want
    assert sum(got) == layers * budget and all(w < b <= trigger - w for b in got)
    assert got == sorted(got, reverse=True) and (got[0] > got[-1]) == (beta > 1 and want[0] != budget)
