"""What each `--method` samples and screens (DESIGN section 2), read by the controller, the grid and the report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """What a method samples and screens. Screening needs helper candidates, so that every step has a
    candidate the detector cannot drop."""

    base: bool
    helper: bool
    budgeted: bool  # its base runs under a KV budget B (a cell per --budget); `GridOptions.evicts` adds --evictor
    detector: bool

    def __post_init__(self) -> None:
        if self.detector and not self.helper:
            raise ValueError("a method that screens base candidates needs helper candidates")


METHODS: dict[str, Method] = {
    "kvrescue": Method(base=True, helper=True, budgeted=True, detector=True),
    "interleave": Method(base=True, helper=True, budgeted=True, detector=False),
    "bon": Method(base=True, helper=False, budgeted=True, detector=False),
    "full": Method(base=True, helper=False, budgeted=False, detector=False),
    "helper": Method(base=False, helper=True, budgeted=False, detector=False),
}
