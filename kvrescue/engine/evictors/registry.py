"""The engine's evictors by name, one implementation for each name of the catalogue (`kvrescue.evictor_catalogue`),
and how the bounded cache asks for one."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from kvrescue.engine.evictors.adakv import AdaKV
from kvrescue.engine.evictors.base import Evictor, keep_top
from kvrescue.engine.evictors.h2o import H2O
from kvrescue.engine.evictors.keydiff import KeyDiff
from kvrescue.engine.evictors.knorm import KNorm
from kvrescue.engine.evictors.pyramidkv import PyramidKV
from kvrescue.engine.evictors.random import Random
from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.snapkv import SnapKV
from kvrescue.engine.evictors.streaming import Streaming
from kvrescue.engine.evictors.tova import TOVA
from kvrescue.evictor_catalogue import look_up, with_params

EVICTORS: dict[str, Evictor] = {e.name: e for e in (RKV(), SnapKV(), Streaming(), TOVA(), H2O(), KNorm(), KeyDiff(),
                                                    Random(), PyramidKV(), AdaKV())}


def evictor_named(evictor: Evictor | str) -> Evictor:
    """A policy given as itself or by name (its default settings)."""
    return evictor if isinstance(evictor, Evictor) else look_up(EVICTORS, evictor)


def make_evictor(name: str, params: dict[str, Any]) -> Evictor:
    """The named policy with `params` in place of its defaults (ValueError for a value it refuses)."""
    return with_params(evictor_named(name), params)


def keep_positions(evictor: Evictor | str, keys: Tensor, queries: Tensor, budget: int,
                   received: Tensor | None = None) -> Tensor:
    """Kept positions [..., H_kv, budget] under a policy (a name: its default settings)."""
    return keep_top(evictor_named(evictor).score(keys, queries, received), budget)
