"""cascade_fit's least squares: the constants of the cascade cost model that produced a set of times, back."""

import pytest

from benchmarks.speed.cascade_fit import fit
from kvrescue.shapes import CascadeCost


def test_the_fit_recovers_the_model_that_timed_the_shapes() -> None:
    truth = CascadeCost(bytes_per_s=2e9, pass_s=1.5e-3, query_s=20e-6)
    shapes = []
    for rows in (8, 64, 512):
        for re_read in (1e5, 1e6, 1e7, 1e8):
            cascade_ms = 20 + rows * 0.05  # what both pay, and more: the fit reads only their difference
            saved_s = re_read / truth.bytes_per_s - truth.extra_s(rows)
            shapes.append({"rows": rows, "model": {"re_read_bytes": re_read},
                           "paged": {"ms_per_layer": cascade_ms + 1e3 * saved_s},
                           "cascade": {"ms_per_layer": cascade_ms}})
    fitted = fit(shapes)
    assert fitted.bytes_per_s == pytest.approx(truth.bytes_per_s, rel=1e-6)
    assert fitted.pass_s == pytest.approx(truth.pass_s, rel=1e-6)
    assert fitted.query_s == pytest.approx(truth.query_s, rel=1e-6)
