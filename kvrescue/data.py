"""Problem sets: the five benchmarks by name, or any JSONL file.

A benchmark name is read from `--data-dir` / $KVRESCUE_DATA_DIR when given, else from the copy bundled in
this package (`kvrescue/problem_sets/`, provenance and licences in its SOURCES.md), else from the Hugging
Face Hub through `datasets` (only when the bundled file is absent).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from grader import raw_answer
from kvrescue.errors import InputError
from kvrescue.jsonl import read_jsonl, require_field

DATA_DIR_ENV = "KVRESCUE_DATA_DIR"
BUNDLED = Path(__file__).resolve().parent / "problem_sets"
GENERIC = "generic"


@dataclass(frozen=True)
class BenchSpec:
    """Where a benchmark lives and which field holds its problem text."""

    name: str
    size: int
    problem_field: str
    hub_repo: str
    hub_config: str | None
    hub_split: str
    licence: str  # as stated upstream (kvrescue/problem_sets/SOURCES.md)


BENCHES: dict[str, BenchSpec] = {
    spec.name: spec
    for spec in (
        BenchSpec("math500", 500, "problem", "HuggingFaceH4/MATH-500", None, "test", "MIT"),
        BenchSpec("gsm8k", 1319, "question", "openai/gsm8k", "main", "test", "MIT"),
        BenchSpec("aime24", 30, "question", "HuggingFaceH4/aime_2024", None, "train", "none stated (MAA problems)"),
        BenchSpec("amc23", 40, "question", "math-ai/amc23", None, "test", "none stated (MAA problems)"),
        BenchSpec("olympiadbench", 675, "question", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
                  "none stated"),
    )
}


@dataclass(frozen=True)
class Problem:
    """One problem: its position in the set, its text and its raw final answer (DESIGN section 6)."""

    idx: int
    problem: str
    gt: str
    record: dict = field(repr=False, compare=False)


@dataclass(frozen=True)
class ProblemSet:
    name: str
    grading_bench: str
    source: str
    problems: list[Problem]


def data_dir(explicit: Path | None) -> Path | None:
    """The benchmark folder asked for: `--data-dir`, else $KVRESCUE_DATA_DIR, else None (bundled, then the Hub)."""
    if explicit is not None:
        return explicit
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else None


def grading_bench(name: str) -> str:
    """The grader's treatment for a set name: its own for the five benchmarks, gsm8k-style otherwise."""
    return name if name in BENCHES else GENERIC


def bench_file(name: str, folder: Path | None) -> Path | None:
    """The JSONL a benchmark is read from: in `folder` when given, else the bundled copy; None: the Hub."""
    if folder is not None:
        return folder / f"{name}.jsonl"
    bundled = BUNDLED / f"{name}.jsonl"
    return bundled if bundled.is_file() else None


def source_of(name: str, folder: Path | None) -> str:
    """Where `load_problems(name)` would read a benchmark from."""
    spec = BENCHES[name]
    path = bench_file(name, folder)
    if path is not None:
        return f"bundled: {path}" if folder is None else str(path)
    config = f" ({spec.hub_config})" if spec.hub_config else ""
    return f"hub: {spec.hub_repo}{config} [{spec.hub_split}]"


def load_problems(
    bench: str,
    *,
    folder: Path | None = None,
    problem_field: str | None = None,
    answer_field: str | None = None,
    limit: int | None = None,
) -> ProblemSet:
    """A benchmark by name (from `folder`, else bundled, else the Hub) or a JSONL file by path."""
    if bench in BENCHES:
        spec = BENCHES[bench]
        path = bench_file(bench, folder)
        if path is not None:
            if not os.path.lexists(path):
                raise InputError(f"benchmark '{bench}' not found in the data folder", path=path)
            rows, source = read_jsonl(path), str(path)
        else:
            rows, source = _hub_rows(spec), source_of(bench, None)
        name, usual_field = bench, spec.problem_field
    else:
        path = Path(bench)
        if not os.path.lexists(path):
            if path.suffix or len(path.parts) > 1:  # a path, not a benchmark's name
                raise InputError("no such file", path=path)
            known = ", ".join(BENCHES)
            raise InputError(f"unknown benchmark '{bench}': use one of {known} or a path to a JSONL file")
        rows, source, name, usual_field = read_jsonl(path), str(path), path.stem, None
    if not rows:
        raise InputError("no problems in file", path=source)
    field_name = problem_field or (usual_field if usual_field in rows[0][1] else _guess_problem_field(rows, source))
    treatment = grading_bench(name)
    problems = [
        _problem(position, line, record, source, field_name, answer_field, treatment)
        for position, (line, record) in enumerate(rows)
    ]
    if limit is not None:
        problems = problems[:limit]
    return ProblemSet(name=name, grading_bench=treatment, source=source, problems=problems)


def _problem(
    position: int, line: int, record: dict, source: str, problem_field: str, answer_field: str | None, bench: str
) -> Problem:
    text = require_field(record, problem_field, source, line)
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"field '{problem_field}' is not a non-empty string", path=source, line=line)
    gt = raw_gt(record, bench, answer_field or ("answer" if bench == GENERIC else None), source, line)
    return Problem(idx=position, problem=text, gt=gt, record=record)


def raw_gt(record: dict, bench: str, field: str | None, source: str, line: int) -> str:
    """The raw final answer: `field` when the record has it, else derived from the benchmark's own fields."""
    if field is not None and field in record:
        return _answer_text(record[field], field, source, line)
    if bench == GENERIC:
        raise InputError(f"missing field '{field or 'answer'}'", path=source, line=line)
    try:
        answer = raw_answer(record, bench)
    except (KeyError, IndexError, TypeError, AttributeError):
        missing = f"field '{field}' missing and no" if field else "no"
        raise InputError(f"{missing} {bench} answer field to derive the answer from", path=source, line=line) from None
    except ValueError as err:  # the field is there but holds no final answer
        raise InputError(f"cannot derive the {bench} answer: {err}", path=source, line=line) from None
    return _answer_text(answer, f"{bench} answer", source, line)


def _answer_text(value: object, field: str, source: str, line: int) -> str:
    """A raw answer as text: strings as they are, numbers as `str()` does; anything else is an error."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InputError(f"field '{field}' is {type(value).__name__}, not a string or number", path=source, line=line)
    return str(value)


def _guess_problem_field(rows: list[tuple[int, dict]], source: str) -> str:
    line, first = rows[0]
    for name in ("problem", "question"):
        if name in first:
            return name
    raise InputError("no 'problem' or 'question' field (use --problem-field)", path=source, line=line)


def _hub_rows(spec: BenchSpec) -> list[tuple[int, dict]]:
    try:
        import datasets

        table = datasets.load_dataset(spec.hub_repo, spec.hub_config, split=spec.hub_split)
    except Exception as err:  # network, auth or a missing dataset: all end the same way for the user
        raise InputError(
            f"cannot load '{spec.name}' from the Hugging Face Hub ({spec.hub_repo}): {type(err).__name__}; "
            f"pass --data-dir or set {DATA_DIR_ENV} to a folder holding {spec.name}.jsonl"
        ) from None
    return [(number, dict(row)) for number, row in enumerate(table, start=1)]
