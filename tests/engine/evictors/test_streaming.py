"""StreamingLLM: the sinks and the most recent positions."""

from __future__ import annotations

import pytest

from tests.oracles import streaming_keep


@pytest.mark.parametrize("length,budget", [(17, 16), (200, 64), (700, 512)])
def test_streaming_keeps_sinks_and_recent(length, budget):
    expected = list(range(4)) + list(range(length - (budget - 4), length))
    assert streaming_keep(length, budget).tolist() == expected


def test_streaming_budget_bounds():
    assert streaming_keep(20, 12).tolist() == [0, 1, 2, 3, *range(12, 20)]  # the smallest budget: sinks + window
    with pytest.raises(ValueError, match=r"^need 12 <= budget 11 < length 20$"):
        streaming_keep(20, 11)
