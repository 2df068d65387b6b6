"""`kvrescue grade` and `kvrescue bench` through real subprocesses of the installed console script."""

import os
import subprocess

import orjson
import pytest

from kvrescue.data import BUNDLED
from tests.helpers import KVRESCUE, ROOT

EXAMPLE = ROOT / "examples" / "gsm8k_outputs.jsonl"


def kvrescue(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KVRESCUE, *args], input=stdin, capture_output=True, timeout=300, env=env)


def test_grade_example_file_to_stdout():
    done = kvrescue("grade", str(EXAMPLE), "--bench", "gsm8k")
    assert done.returncode == 0, done.stderr.decode()
    records = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert [r["correct"] for r in records] == [True, True, True, False, True, True, False, True]
    assert records[2]["pred"] == "70,000" and records[6]["pred"] == "160"  # "160" by the last-number fallback
    assert all({"pred", "gt_norm", "correct", "timed_out", "question"} <= set(r) for r in records)
    assert b"accuracy" in done.stderr and b"75.0%" in done.stderr


def test_grade_reads_stdin_in_a_pipeline():
    done = kvrescue("grade", "-", "--bench", "gsm8k", stdin=EXAMPLE.read_bytes())
    assert done.returncode == 0, done.stderr.decode()
    assert len(done.stdout.splitlines()) == 8


def test_grade_benchmark_native_records_derive_the_answer(tmp_path):
    rows = [orjson.loads(line) for line in (BUNDLED / "gsm8k.jsonl").read_bytes().splitlines()[:3]]
    for row in rows:
        row["output"] = "\\boxed{" + row["answer"].split("####")[1].strip() + "}"
    source = tmp_path / "native.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    done = kvrescue("grade", str(source), "--bench", "gsm8k", "--workers", "2")
    assert done.returncode == 0, done.stderr.decode()
    assert all(orjson.loads(line)["correct"] for line in done.stdout.splitlines())


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"output": "1", "gt": "1"}\n{"output": \n', b"bad.jsonl:2: malformed JSON"),
        (b'{"output": "1", "gt": "1"}\n{"gt": "2"}\n', b"bad.jsonl:2: missing field 'output'"),
        (b'{"output": "\xff\xfe", "gt": "1"}\n', b"bad.jsonl:1: not UTF-8"),
    ],
)
def test_bad_input_is_one_line_error_and_nothing_written(tmp_path, content, message):
    source = tmp_path / "bad.jsonl"
    source.write_bytes(content)
    out = tmp_path / "graded.jsonl"
    done = kvrescue("grade", str(source), "--bench", "gsm8k", "--out", str(out))
    assert done.returncode == 2
    assert message in done.stderr and b"Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [source]


def test_unknown_bench_is_refused():
    done = kvrescue("grade", str(EXAMPLE), "--bench", "mmlu")
    assert done.returncode == 2 and b"unknown bench 'mmlu'" in done.stderr


def test_grade_out_file_is_written_whole(tmp_path):
    out = tmp_path / "sub" / "graded.jsonl"
    done = kvrescue("grade", str(EXAMPLE), "--bench", "gsm8k", "--out", str(out))
    assert done.returncode == 0 and done.stdout == b""
    assert len(out.read_bytes().splitlines()) == 8


def bench_table(*args: str) -> list[list[str]]:
    """`kvrescue bench` cells, one list per row (no $KVRESCUE_DATA_DIR, wide enough for one line per row)."""
    env = {k: v for k, v in os.environ.items() if k != "KVRESCUE_DATA_DIR"} | {"COLUMNS": "400"}
    done = kvrescue("bench", *args, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return [[c.strip() for c in line.split("│")[1:-1]] for line in done.stdout.decode().splitlines() if line.startswith("│")]


SIZES = {"math500": 500, "gsm8k": 1319, "aime24": 30, "amc23": 40, "olympiadbench": 675}


def test_bench_lists_the_bundled_sets_with_sizes_and_licences():
    cells = bench_table()
    assert {row[0]: int(row[1]) for row in cells} == SIZES
    assert {row[0]: row[2] for row in cells} == {name: "problem" if name == "math500" else "question" for name in SIZES}
    assert {row[0]: row[3] for row in cells}["gsm8k"] == "MIT"
    assert all(row[4] == f"bundled: {BUNDLED / row[0]}.jsonl" for row in cells)


def test_bench_data_dir_overrides_the_bundled_sets(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_bytes(b"".join((BUNDLED / "gsm8k.jsonl").read_bytes().splitlines(True)[:5]))
    cells = {row[0]: row for row in bench_table("--data-dir", str(tmp_path))}
    assert cells["gsm8k"][1] == "5" and cells["gsm8k"][4] == str(tmp_path / "gsm8k.jsonl")
    assert cells["math500"][1] == "missing"
