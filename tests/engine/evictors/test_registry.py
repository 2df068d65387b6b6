"""The engine's evictors by name: one for each name of the catalogue, frozen dataclasses of their parameters."""

from __future__ import annotations

import pytest
import torch

from kvrescue.engine.evictors.adakv import SCORERS
from kvrescue.engine.evictors.registry import EVICTORS, keep_positions, make_evictor
from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.streaming import Streaming
from kvrescue.evictor_catalogue import ADAKV_SCORES, CATALOGUE
from tests.engine.evictors.loops import loop_rkv, random_inputs
from tests.oracles import streaming_keep


def test_every_policy_scores_on_the_keys_device():
    """The meta device stands in for a GPU: a position tensor made on the CPU beside it is an error."""
    keys, queries = random_inputs(2, 2, 40, 8, seed=1)
    received = torch.rand(1, 2, 40, device="meta")
    for policy in EVICTORS:
        kept = keep_positions(policy, keys[None].to("meta"), queries[None].to("meta"), 16, received)
        assert kept.device.type == "meta" and kept.shape == (1, 2, 16)


def test_policies_are_frozen_dataclasses_of_their_parameters():
    assert {name: e.params() for name, e in EVICTORS.items()} == {
        "rkv": {"lam": 0.1, "kernel": 7, "threshold": 0.5}, "snapkv": {"kernel": 7}, "streaming": {"sinks": 4},
        "tova": {}, "h2o": {}, "knorm": {}, "keydiff": {}, "random": {"seed": 0}, "pyramidkv": {"kernel": 7, "beta": 20},
        "adakv": {"scores": "rkv", "safeguard": 0.2}}
    assert [e.name for e in EVICTORS.values() if e.accumulates] == ["h2o"]
    assert [e.name for e in EVICTORS.values() if e.allocates] == ["pyramidkv", "adakv"]
    with pytest.raises(AttributeError):
        EVICTORS["rkv"].lam = 0.5
    keys, queries = random_inputs(2, 2, 40, 8, seed=3)
    assert torch.equal(keep_positions(RKV(lam=0.5), keys, queries, 16), loop_rkv(keys, queries, 16, lam=0.5)[0])
    assert torch.equal(keep_positions(Streaming(sinks=2), keys, queries, 16)[0], streaming_keep(40, 16, sinks=2))


def test_the_registry_implements_each_evictor_of_the_catalogue_with_its_settings():
    """One list of names: each implementation is the catalogue's settings of its name that scores, at the same
    defaults, and no name is one side's alone; a name with parameters makes the implementation."""
    assert list(EVICTORS) == list(CATALOGUE)
    for name, evictor in EVICTORS.items():
        assert type(evictor).__mro__[1] is type(CATALOGUE[name]) and evictor.params() == CATALOGUE[name].params()
    assert tuple(SCORERS) == ADAKV_SCORES  # the scores Ada-KV may name, each implemented
    assert make_evictor("streaming", {"sinks": 2}) == Streaming(sinks=2)
