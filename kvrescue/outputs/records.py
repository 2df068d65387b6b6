"""The records of a run folder: one `Trace` per problem (its `Step`s, `Candidate`s and `Tokens`) and the
`RunConfig` identity that names the folder. Every field is documented in `kvrescue.outputs`."""

from __future__ import annotations

import functools
import hashlib
import numbers
import re
import time
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from kvrescue.reasons import FAILED, FINISHES, SKIPPED, STOPS, UNDECODED

SOURCES = ("base", "helper")
ANSWER_FROM = ("output", "after_think")


@dataclass
class Step:
    """One committed reasoning step."""

    text: str
    source: str
    score: float | None
    tokens: int
    base_rows: int | None = None  # the base cache row's physical length after the commit


@dataclass
class Candidate:
    """One sampled candidate for a step (committed or not)."""

    source: str
    score: float | None
    tokens: int
    finish: str
    max_mean_entropy: float | None = None
    min_gzip_ratio: float | None = None
    fired_at: int | None = None
    committed: bool = False
    text: str | None = None  # what it decoded (up to where the detector stopped it); null for the committed one
    pred: str | None = None  # a voter's (`grading.voters`) answer, normalised by the grader; else null
    correct: bool | None = None  # that answer's verdict; else null


@dataclass
class Tokens:
    """Token counts per model for one problem."""

    base: int = 0
    base_prefill: int = 0
    helper: int = 0
    helper_prefill: int = 0
    prm: int = 0


@dataclass
class Trace:
    """Everything recorded about one finished (or skipped) problem."""

    idx: int
    problem: str
    gt: str
    gt_norm: str
    steps: list[Step]
    candidates: list[list[Candidate]]
    output: str
    pred: str
    correct: bool
    timed_out: bool
    stop: str
    skip_reason: str | None
    tokens: Tokens
    n_steps: int
    timings: dict[str, float]
    peak_base_rows: int
    prm_truncations: int
    graders: dict[str, dict[str, Any]] = field(default_factory=dict)  # --also-grade: {pred, correct, timed_out}
    answer_from: str = "output"  # "after_think": the answer was read after the output's last </think>
    prm_unseen: int = 0  # candidates the PRM saw no token of, scored the lowest (engine.scoring.UNSEEN_SCORE)

    @classmethod
    def skipped(cls, idx: int, problem: str, gt: str, gt_norm: str, reason: str) -> Trace:
        """The record of a problem that was not decoded (e.g. its prompt exceeds the context cap)."""
        now = time.time()
        return cls(idx, problem, gt, gt_norm, [], [], "", "", False, False, SKIPPED, reason,
                   Tokens(), 0, {"wall_s": 0.0, "started_at": now, "finished_at": now}, 0, 0)

    @classmethod
    def failed(cls, idx: int, problem: str, gt: str, gt_norm: str, error: str) -> Trace:
        """The record of a problem given up on because decoding it killed worker processes."""
        trace = cls.skipped(idx, problem, gt, gt_norm, error)
        trace.stop = FAILED
        return trace

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        """Rebuild a trace from its JSON form (raises KeyError/TypeError/ValueError if malformed)."""
        d = dict(d)
        # `no_survivor` (always false: a screened method always has helper candidates) is no longer written.
        d["steps"] = [Step(**{k: v for k, v in s.items() if k != "no_survivor"}) for s in d["steps"]]
        d["candidates"] = [[Candidate(**c) for c in cs] for cs in d["candidates"]]
        d["tokens"] = Tokens(**d["tokens"])
        trace = cls(**d)
        trace.check()
        return trace

    def check(self) -> None:
        """Raise ValueError when the record breaks the format's invariants (a field of another type included)."""
        wrong = type_error(self)
        if wrong:
            raise ValueError(f"trace idx {self.idx!r}: {wrong}")
        problems = []
        if self.stop not in STOPS:
            problems.append(f"stop {self.stop!r} not in {STOPS}")
        if self.n_steps != len(self.steps):
            problems.append(f"n_steps {self.n_steps} != {len(self.steps)} steps")
        if len(self.candidates) != len(self.steps):
            problems.append(f"{len(self.candidates)} candidate lists for {len(self.steps)} steps")
        if self.stop in UNDECODED and not self.skip_reason:
            problems.append(f"{self.stop} without skip_reason")
        for i, (step, cands) in enumerate(zip(self.steps, self.candidates)):
            if step.source not in SOURCES:
                problems.append(f"step {i}: source {step.source!r}")
            if sum(c.committed for c in cands) != 1:
                problems.append(f"step {i}: {sum(c.committed for c in cands)} committed candidates")
            for c in cands:
                if c.source not in SOURCES or c.finish not in FINISHES:
                    problems.append(f"step {i}: candidate source/finish {c.source!r}/{c.finish!r}")
        for name, verdict in self.graders.items():
            if not (isinstance(verdict, dict) and set(verdict) == {"pred", "correct", "timed_out"}
                    and isinstance(verdict["pred"], str) and isinstance(verdict["correct"], bool)
                    and isinstance(verdict["timed_out"], bool)):
                problems.append(f"graders[{name!r}]: expected {{pred, correct, timed_out}}")
        if self.answer_from not in ANSWER_FROM:
            problems.append(f"answer_from {self.answer_from!r} not in {ANSWER_FROM}")
        missing = {"wall_s", "started_at", "finished_at"} - set(self.timings)
        if missing:
            problems.append(f"timings lack {sorted(missing)}")
        if problems:
            raise ValueError(f"trace idx {self.idx}: " + "; ".join(problems))


@dataclass(frozen=True)
class ModelRef:
    """A model as given (Hub id, local folder or GGUF file) and its revision (`model_config.model_revision`), if known."""

    id: str
    revision: str | None = None


@dataclass
class RunConfig:
    """The identity of a run: every setting that changes its results.

    `settings` holds the rest of them (sampling, detector thresholds, caps, dtype, data checksum, ...);
    values must be JSON-serialisable. Versions, host, devices and `--limit` are not identity.
    """

    bench: str
    method: str
    budget: int | None
    n: int
    evictor: str
    seed: int
    models: dict[str, ModelRef]
    scorer: str
    synthetic: bool = False
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The identity as plain JSON data."""
        return orjson.loads(orjson.dumps(asdict(self), option=orjson.OPT_SORT_KEYS))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """Rebuild a configuration from config.json's `config` (raises KeyError/TypeError/ValueError if malformed)."""
        d = dict(d)
        d["models"] = {k: ModelRef(**v) for k, v in d["models"].items()}
        config = cls(**d)
        settings = config.settings  # those read back (report, view, resume): numbers where numbers are recorded
        wrong = (type_error(config)
                 or type_error(settings.get("detector"), dict[str, float] | None, "settings.detector")
                 or type_error(settings.get("buffer"), int | None, "settings.buffer")
                 or type_error(settings.get("evictor_params"), dict[str, float | str] | None, "settings.evictor_params"))
        if wrong:
            raise ValueError(wrong)
        return config

    def digest(self) -> str:
        """SHA-256 (hex) of the identity."""
        return hashlib.sha256(orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)).hexdigest()

    def folder_name(self) -> str:
        """`<method>-<evictor>-b<budget>-n<N>-s<seed>-<hash8>`; budget `full` when there is none."""
        budget = "full" if self.budget is None else str(self.budget)
        return f"{self.method}-{self.evictor}-b{budget}-n{self.n}-s{self.seed}-{self.digest()[:8]}"

    def bench_name(self) -> str:
        """The bench as a folder name: a known name as is, a JSONL path by its file stem; never a name
        that leaves the root (no separators, no leading dots) or hides there."""
        stem = Path(self.bench).stem if self.bench.endswith(".jsonl") else self.bench
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).lstrip(".") or "bench"


def type_error(value: Any, hint: Any = None, where: str = "") -> str | None:
    """What in `value` does not have the type its dataclass fields declare ("tokens.base is 'x', not int"),
    or None. `hint` checks a value against a type instead (int, float, str, bool, None, X | Y, list[X],
    dict[str, X], a dataclass, Any); an int is no bool, a float may be an int, numpy's numbers count."""
    wrong = _checker(type(value) if hint is None else hint)(value)
    if wrong is None:
        return None
    path, bad, need = wrong
    return f"{(where + ''.join(reversed(path))).lstrip('.') or 'record'} is {bad!r:.60}, not {need}"


Wrong = tuple[list[str], Any, str]  # (the path to the bad value, innermost part first; the value; what it should be)
Checker = Callable[[Any], "Wrong | None"]


@functools.cache
def _checker(hint: Any) -> Checker:
    """A fast check of values against `hint` (built once per type: reports read many thousands of records)."""
    if hint is Any:
        return lambda v: None
    if is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        parts = [(f.name, f".{f.name}", _exact(hints[f.name]), _checker(hints[f.name])) for f in fields(hint)]

        def check_record(v: Any) -> Wrong | None:
            if not isinstance(v, hint):
                return [], v, "an object"
            for name, step, exact, check in parts:
                x = getattr(v, name)
                if type(x) in exact:
                    continue
                wrong = check(x)
                if wrong is not None:
                    wrong[0].append(step)
                    return wrong
            return None
        return check_record
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    need = getattr(hint, "__name__", None) or str(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(option) for option in args]
        return lambda v: None if any(check(v) is None for check in options) else ([], v, need)
    if origin in (list, dict):
        key = _checker(args[0]) if origin is dict else None
        item = _checker(args[-1])

        def check_items(v: Any) -> Wrong | None:
            if not isinstance(v, origin):
                return [], v, need
            for k, x in v.items() if origin is dict else enumerate(v):
                wrong = (key and key(k)) or item(x)
                if wrong is not None:
                    wrong[0].append(f".{k}" if origin is dict else f"[{k}]")
                    return wrong
            return None
        return check_items
    if hint is type(None):
        return lambda v: None if v is None else ([], v, "null")
    if hint in (int, float):  # numpy's numbers too (a trace as the engine hands it over)
        exact = (int,) if hint is int else (int, float)
        abstract = numbers.Integral if hint is int else numbers.Real
        return lambda v: None if type(v) in exact or (isinstance(v, abstract) and not isinstance(v, bool)) \
            else ([], v, need)
    return lambda v: None if isinstance(v, hint) else ([], v, need)


@functools.cache
def _exact(hint: Any) -> frozenset[type]:
    """Types whose values always satisfy `hint` (the fast path of `_checker`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return frozenset().union(*map(_exact, typing.get_args(hint)))
    return {int: frozenset({int}), float: frozenset({int, float}), str: frozenset({str}), bool: frozenset({bool}),
            type(None): frozenset({type(None)})}.get(hint, frozenset())
