"""`kvrescue run`'s options by concern: each built and checked alone, and the grid's options their union."""

import dataclasses
from pathlib import Path

import pytest

from kvrescue.errors import InputError
from kvrescue.grid import GridOptions
from kvrescue.run_options import (
    CONCERNS, EngineOptions, GradingOptions, GridAxes, ModelOptions, Placement, RunIO, parse_shard, split_scorer,
)


@pytest.mark.parametrize("concern, message", [
    (RunIO(out=Path("runs"), shard=(2, 2)), "--shard 2/2: need 0 <= i < k"),
    (Placement(devices=("cpu", "cpu", "cpu"), tp=2), "--tp 2"),
    (EngineOptions(buffer=0), "--buffer 0: need at least 1 entry past the budget"),
    (EngineOptions(dtype="float64"), "unknown --dtype 'float64'"),
    (EngineOptions(engine="sglang"), "--engine 'sglang': expected native or vllm"),
    (EngineOptions(vllm_memory=1.0), "--vllm-memory 1.0: expected a share of the device between 0 and 1"),
    (ModelOptions(models={}, scorer="majority"), "unknown scorer 'majority'"),
    (ModelOptions(models={}, scorer="prm", prompt="chat"), "unknown --prompt 'chat'"),
    (GradingOptions(also_grade=("sympy",)), "--also-grade"),
])
def test_each_concern_checks_its_own_options_alone(concern, message):
    with pytest.raises(InputError) as refused:
        concern.check()
    assert message in str(refused.value)


def test_each_concerns_defaults_pass_its_check():
    RunIO(out=Path("runs")).check()
    ModelOptions(models={"base": "b"}, scorer="prm").check()
    for concern in (Placement, EngineOptions, GradingOptions):
        concern().check()


def test_the_grids_options_are_the_concerns_fields_and_the_grids_own():
    union = {f.name for f in dataclasses.fields(GridOptions)}
    concerns = [{f.name for f in dataclasses.fields(c)} for c in CONCERNS]
    assert sum(map(len, concerns)) == len(set().union(*concerns))  # no field in two concerns
    assert union - set().union(*concerns) == {*vars(GridAxes(*[[]] * 5)), "evictor", "evictor_params", "settings",
                                              "grids"}
    assert all(issubclass(GridOptions, c) for c in CONCERNS)


def test_shard_and_scorer_parsing():
    assert parse_shard(None) is None and parse_shard("1/4") == (1, 4)
    with pytest.raises(InputError, match="--shard '1-4': expected i/k"):
        parse_shard("1-4")
    models = {"base": "b", "helper": "h", "prm": "helper-loglik"}
    assert split_scorer(models) == ({"base": "b", "helper": "h"}, "helper-loglik")
    assert split_scorer({**models, "prm": "p"}) == ({**models, "prm": "p"}, "prm")
