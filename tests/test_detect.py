"""The degeneration detector against DESIGN section 4, thresholds recomputed here independently."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from kvrescue.detect import DetectorConfig, gzip_ratio
from kvrescue.data import BUNDLED
from tests.oracles import Detector



def pieces(text: str) -> list[str]:
    """Word-like token texts that concatenate back to ``text``."""
    return re.findall(r"\S+\s*|\s+", text)


def solutions(min_chars: int = 0) -> list[str]:
    with open(BUNDLED / "math500.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [r["solution"] for r in rows if len(r["solution"]) >= min_chars]


def first_compressible(tokens: list[str], chars: int = 800, tau: float = 0.18) -> int | None:
    """1-based index of the first token after which the last ``chars`` characters compress under tau."""
    text = ""
    for i, tok in enumerate(tokens, 1):
        text += tok
        if len(text) >= chars:
            window = text[-chars:].encode("utf-8")
            if len(gzip.compress(window, compresslevel=9, mtime=0)) / len(window) < tau:
                return i
    return None


def test_looping_text_fires_repetition_where_the_window_first_compresses():
    loop = "So we add 3 to both sides and get x = 5, which means we add 3 to both sides again. "
    tokens = pieces(solutions(1500)[0] + loop * 40)
    expected = first_compressible(tokens)
    assert expected is not None
    det = Detector()
    for i, tok in enumerate(tokens, 1):
        reason = det.update(tok, 1.0)
        if i < expected:
            assert reason is None
        else:
            assert reason == "repetition"
            break
    assert (det.fired, det.fired_at, det.tokens) == ("repetition", expected, expected)
    assert det.min_gzip_ratio < 0.18
    assert det.max_mean_entropy == pytest.approx(1.0)
    assert det.update("more", 1.0) == "repetition" and det.tokens == expected


def test_high_entropy_fires_only_from_token_24():
    det = Detector()
    for i in range(1, 24):
        assert det.update("é", 9.5) is None, i
    assert det.max_mean_entropy is None
    assert det.update("é", 9.5) == "entropy"
    assert (det.fired, det.fired_at, det.max_mean_entropy) == ("entropy", 24, pytest.approx(9.5))
    assert det.min_gzip_ratio is None  # never 800 characters


def test_entropy_mean_is_over_the_last_12_tokens():
    entropies = [2.0] * 30 + [10.0] * 20
    # mean of the last 12 with k high tokens: (10k + 2(12 - k)) / 12 > 7  <=>  k >= 8
    det = Detector()
    fired = [det.update("a ", h) for h in entropies]
    assert fired.index("entropy") + 1 == 30 + 8
    assert det.max_mean_entropy == pytest.approx((10 * 8 + 2 * 4) / 12)


def test_entropy_at_the_threshold_does_not_fire():
    det = Detector()
    assert all(det.update("b ", 7.0) is None for _ in range(100))
    assert det.max_mean_entropy == pytest.approx(7.0)


def test_real_solutions_never_fire():
    texts = solutions(800)
    assert len(texts) > 50
    for text in texts:
        det = Detector()
        so_far, ratios = "", []
        for tok in pieces(text):
            assert det.update(tok, 2.5) is None, text[:80]
            so_far += tok
            if len(so_far) >= 800:
                ratios.append(gzip_ratio(so_far[-800:]))
        assert det.min_gzip_ratio == min(ratios) >= 0.18


def test_thresholds_are_options():
    assert Detector().update("a" * 100, 0.5) is None  # under 800 characters: not checked
    assert Detector(DetectorConfig(cmp_chars=100, tau_cmp=0.3)).update("a" * 100, 0.5) == "repetition"
    assert Detector(DetectorConfig(cmp_chars=100)).update("a" * 100, 0.5) is None  # ratio 0.24
    det = Detector(DetectorConfig(tau_ent=1.0, ent_window=2, min_tokens=3))
    assert [det.update("x", h) for h in (3.0, 3.0, 0.5)] == [None, None, "entropy"]


def test_empty_pieces_keep_the_ratio():
    det = Detector()
    det.update("z" * 800, 0.0)
    ratio = det.min_gzip_ratio
    assert det.fired == "repetition" and ratio == gzip_ratio("z" * 800)
    det = Detector()
    for tok in pieces(solutions(800)[1])[:400]:
        det.update(tok, 1.0)
    before = det.min_gzip_ratio
    assert det.update("", 1.0) is None and det.min_gzip_ratio == before


def test_entropy_is_reported_when_both_tests_fire_on_the_same_token():
    config = DetectorConfig(tau_ent=1.0, ent_window=2, min_tokens=3, tau_cmp=0.3, cmp_chars=100)
    det = Detector(config)
    assert [det.update("a" * 40, 5.0) for _ in range(2)] == [None, None]  # 80 characters, 2 tokens: neither checked
    assert det.update("a" * 40, 5.0) == "entropy"  # token 3: mean entropy 5 > 1 and ratio 0.24 < 0.3 together
    assert (det.fired, det.fired_at) == ("entropy", 3)
    assert det.min_gzip_ratio == gzip_ratio("a" * 100) < 0.3 and det.max_mean_entropy == 5.0
    det = Detector(config)  # the same text with low entropy: the repetition test alone
    assert [det.update("a" * 40, 0.5) for _ in range(3)] == [None, None, "repetition"]


def test_nothing_is_recorded_before_the_tests_apply():
    det = Detector()
    assert det.update("", 1.0) is None  # an empty first piece: no text, no ratio
    assert (det.fired, det.fired_at, det.min_gzip_ratio, det.max_mean_entropy) == (None, None, None, None)


def test_the_gzip_level_is_an_option():
    det = Detector(DetectorConfig(cmp_chars=100, gzip_level=0))  # level 0 stores: the ratio exceeds 1
    det.update("a" * 100, 0.0)
    assert det.min_gzip_ratio == gzip_ratio("a" * 100, 0) > 1 > gzip_ratio("a" * 100, 9)
