"""The torch-free catalogue of evictors: `--evictor NAME:FIELD=VALUE,...` parsed against its settings."""

from __future__ import annotations

import re

import pytest

from kvrescue.evictor_catalogue import parse_evictor


def test_evictor_specs_name_typed_parameters_or_a_one_line_error():
    assert parse_evictor("rkv") == ("rkv", {}) and parse_evictor("h3o") == ("h3o", {})  # the caller refuses h3o
    assert parse_evictor("rkv:lam=0.2,kernel=5") == ("rkv", {"lam": 0.2, "kernel": 5})
    assert parse_evictor("adakv:scores=snapkv,safeguard=0.5") == ("adakv", {"scores": "snapkv", "safeguard": 0.5})
    for spec, message in [("h3o:x=1", "unknown evictor 'h3o'"), ("rkv:kernel=4", "kernel=4: the max-pool kernel"),
                          ("snapkv:kernel=2.5", "kernel must be int, not '2.5'"), ("rkv:lam", "'lam' is not FIELD=VALUE"),
                          ("tova:lam=1", "of one of tova's parameters (none)"), ("streaming:sinks=-1", "sinks=-1"),
                          ("random:seed=-1", "seed=-1: need 0 <= seed < 2**63"),
                          ("adakv:scores=h2o", "scores='h2o': choose rkv or snapkv"),
                          ("adakv:safeguard=1.5", "safeguard=1.5: need 0 <= safeguard <= 1"),
                          ("pyramidkv:beta=0", "beta=0: need 1 or more")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_evictor(spec)
