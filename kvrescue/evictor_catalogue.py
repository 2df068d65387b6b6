"""The evictors by name, torch-free (DESIGN section 3): what each is, its flags, its parameters with their defaults and
checks, and `--evictor NAME:FIELD=VALUE,...` parsed against them. The grid, the cell plans and `kvrescue cost` read
this; the engine's implementations (`engine/evictors/`, one per file, each the subclass of its settings here that
scores) are registered against the same names (`engine/evictors/registry.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

from kvrescue.shapes import OBSERVATION_WINDOW

MIN_BUDGET = 2 * OBSERVATION_WINDOW  # the smallest budget B any evictor accepts
NO_EVICTION = "none"  # `--evictor none`: the base keeps a full cache (no evictor runs)


@dataclass(frozen=True)
class EvictorSettings:
    """One evictor's settings, kvpress style: a frozen dataclass whose fields are its parameters (checked when it is
    made). An evictor that `accumulates` has its cache keep the attention each entry received since it entered
    (H2O); one that `allocates` gives the layers or a layer's KV heads budgets of their own (PyramidKV, Ada-KV)."""

    name: ClassVar[str]
    description: ClassVar[str]
    accumulates: ClassVar[bool] = False
    allocates: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        """The parameters by name, as config.json records them."""
        return asdict(self)


def _odd_kernel(kernel: int) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel={kernel}: the max-pool kernel must be odd and positive (same padding)")


@dataclass(frozen=True)
class RKVSettings(EvictorSettings):
    name = "rkv"
    description = "R-KV (Cai et al. 2025): attention importance minus key redundancy"
    lam: float = 0.1
    kernel: int = 7
    threshold: float = 0.5

    def __post_init__(self) -> None:
        _odd_kernel(self.kernel)


@dataclass(frozen=True)
class SnapKVSettings(EvictorSettings):
    name = "snapkv"
    description = "SnapKV (Li et al. 2024) at decode time: attention importance alone"
    kernel: int = 7

    def __post_init__(self) -> None:
        _odd_kernel(self.kernel)


@dataclass(frozen=True)
class StreamingSettings(EvictorSettings):
    name = "streaming"
    description = "StreamingLLM (Xiao et al. 2023): the first positions (attention sinks) and the most recent"
    sinks: int = 4

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks={self.sinks}: need 0 or more")


@dataclass(frozen=True)
class TOVASettings(EvictorSettings):
    name = "tova"
    description = "TOVA (Oren et al. 2024): the newest query's attention alone"


@dataclass(frozen=True)
class H2OSettings(EvictorSettings):
    name = "h2o"
    description = "H2O (Zhang et al. 2023): the attention each entry received from every query since it entered"
    accumulates = True


@dataclass(frozen=True)
class KNormSettings(EvictorSettings):
    name = "knorm"
    description = "Knorm (Devoto et al. 2024): the keys of smallest L2 norm, query-free"


@dataclass(frozen=True)
class KeyDiffSettings(EvictorSettings):
    name = "keydiff"
    description = "KeyDiff (Park et al. 2025): the keys least similar to the mean key, query-free"


@dataclass(frozen=True)
class RandomSettings(EvictorSettings):
    name = "random"
    description = "random: a seeded uniform choice of the past positions"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed}: need 0 <= seed < 2**63")


@dataclass(frozen=True)
class PyramidKVSettings(SnapKVSettings):
    name = "pyramidkv"
    description = "PyramidKV (Cai et al. 2024): SnapKV scores, per-layer budgets shrinking with depth"
    allocates = True
    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta={self.beta}: need 1 or more")


ADAKV_SCORES = ("rkv", "snapkv")  # the evictors whose scores Ada-KV can share out


@dataclass(frozen=True)
class AdaKVSettings(EvictorSettings):
    name = "adakv"
    description = "Ada-KV (Feng et al. 2024): per-head budgets within a layer by score mass, R-KV or SnapKV scores"
    allocates = True
    scores: str = "rkv"
    safeguard: float = 0.2

    def __post_init__(self) -> None:
        if self.scores not in ADAKV_SCORES:
            raise ValueError(f"scores={self.scores!r}: choose {' or '.join(ADAKV_SCORES)}")
        if not 0 <= self.safeguard <= 1:
            raise ValueError(f"safeguard={self.safeguard}: need 0 <= safeguard <= 1")


CATALOGUE: dict[str, EvictorSettings] = {s.name: s for s in (
    RKVSettings(), SnapKVSettings(), StreamingSettings(), TOVASettings(), H2OSettings(), KNormSettings(),
    KeyDiffSettings(), RandomSettings(), PyramidKVSettings(), AdaKVSettings())}
CHOICES = (*CATALOGUE, NO_EVICTION)

E = TypeVar("E", bound=EvictorSettings)


def look_up(table: dict[str, E], name: str) -> E:
    """The evictor called `name` in `table` (the catalogue, or the engine's registry of implementations)."""
    if name not in table:
        raise ValueError(f"policy {name!r} does not compress; choose one of {tuple(table)}")
    return table[name]


def with_params(evictor: E, params: dict[str, Any]) -> E:
    """`evictor` with `params` in place of its settings (ValueError for a value it refuses)."""
    try:
        return replace(evictor, **params)
    except ValueError as err:
        raise ValueError(f"--evictor {evictor.name}: {err}") from None


def evictor_settings(name: str, params: dict[str, Any]) -> EvictorSettings:
    """The named evictor's settings with `params` in place of its defaults."""
    return with_params(look_up(CATALOGUE, name), params)


def parse_evictor(spec: str) -> tuple[str, dict[str, Any]]:
    """`NAME` or `NAME:FIELD=VALUE,...` (`--evictor rkv:lam=0.2,kernel=5`): the name, and the fields given with
    values of their fields' types, checked by making the settings (ValueError naming what is wrong). An unknown
    name without fields is left for the caller to refuse."""
    name, _, given = spec.partition(":")
    if not given:
        return name, {}
    if name not in CATALOGUE:
        raise ValueError(f"unknown evictor {name!r} in --evictor {spec!r}; choose one of {', '.join(CATALOGUE)}")
    kinds = {f.name: {"int": int, "float": float, "str": str}[str(f.type)] for f in fields(CATALOGUE[name])}
    params: dict[str, Any] = {}
    for item in given.split(","):
        key, equals, value = item.partition("=")
        if key not in kinds or not equals:
            have = ", ".join(kinds) or "none"
            raise ValueError(f"--evictor {spec!r}: {item!r} is not FIELD=VALUE of one of {name}'s parameters ({have})")
        try:
            params[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"--evictor {spec!r}: {key} must be {kinds[key].__name__}, not {value!r}") from None
        if kinds[key] is not str and not (abs(params[key]) < 2**63 if kinds[key] is int
                                          else math.isfinite(params[key])):
            raise ValueError(f"--evictor {spec!r}: {key} must be finite and within 64 bits, not {value!r}")
    evictor_settings(name, params)
    return name, params
