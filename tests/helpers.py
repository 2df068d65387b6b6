"""What several test files share: the console script's path, tiny problem files, the CLI run in this process, and
run-folder readers."""

import contextlib
import os
import subprocess
import sys
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]  # the repository
# How long a test waits for a subprocess run's first trace or for it to end: generous, as it only bounds a failure
# (on a 2-core AVX2 machine with the suite's other processes, a TP group's first trace took over 300 s).
RUN_WAIT_S = 900
KVRESCUE = str(Path(sys.executable).parent / "kvrescue")  # the console script installed beside this python
# (a, b) of the tiny problem files: "What is a + b? Let x be the answer.", answer a + b
PAIRS = ((1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1))


def benchmark(script: str, *args: str, **run) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> ARGS` in a process of its own, with the repository root first on its PYTHONPATH
    (the benchmarks import the test kit and one another from the checkout); `run`: subprocess.run's keywords."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], env=env, **run)


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    """`rows` as a JSONL file at `path`."""
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def tiny_problems(path: Path, pairs: Iterable[tuple[int, int]] = PAIRS) -> Path:
    """A problem file of additions `a + b`, one per pair (`PAIRS` by default)."""
    return write_jsonl(path, ({"question": f"What is {a} + {b}? Let x be the answer.", "answer": str(a + b)}
                              for a, b in pairs))


def kvrescue(*args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None,
             text: bool = False) -> subprocess.CompletedProcess:
    """`kvrescue ARGS` in this process (typer's CliRunner), in `cwd` if given, with `env` added to the environment:
    its exit status, stdout and stderr (str with `text`, else bytes) as the console script's; an exception that
    escapes the command is a traceback on stderr and status 1, as in a subprocess. For what only a separate process
    shows (signals, the environment read at import, memory limits, the console script itself) run `KVRESCUE`."""
    from typer.testing import CliRunner

    from kvrescue.cli import app

    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(app, list(args), env=env)
    stdout, stderr = result.stdout_bytes, result.stderr_bytes
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info)).encode()
    if text:
        stdout, stderr = stdout.decode(), stderr.decode()
    return subprocess.CompletedProcess(["kvrescue", *args], result.exit_code, stdout, stderr)


def kvrescue_run(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`kvrescue run ARGS` in this process (`kvrescue`)."""
    return kvrescue("run", *args, env=env)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`done`, after checking that it exited 0 (the end of its stderr otherwise)."""
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def read_folder(root: Path, method: str, bench: str = "tiny") -> tuple[dict, list[dict], dict]:
    """(config.json, traces in file order, summary.json) of the one `method` folder of `bench` under `root`."""
    (folder,) = [p for p in (root / bench).iterdir() if p.name.startswith(method + "-")]
    config = orjson.loads((folder / "config.json").read_bytes())
    return config, read_jsonl(folder / "traces.jsonl"), orjson.loads((folder / "summary.json").read_bytes())


def traces_of(out: Path, method: str = "kvrescue") -> list[dict]:
    """The traces of the one `method` folder of bench `tiny` under `out`, in file order."""
    (path,) = out.glob(f"tiny/{method}-*/traces.jsonl")
    return read_jsonl(path)


def write_run(root: Path, cfg, traces: Iterable) -> Path:
    """A run folder of `cfg` (an `outputs.RunConfig`) under `root` holding `traces` and their summary."""
    from kvrescue.outputs import RunFolder, run_dir

    path = run_dir(root, cfg)
    traces = list(traces)
    with RunFolder.open(path, cfg, total=len(traces)) as rf:
        for t in traces:
            rf.append(t)
        rf.write_summary()
    return path


# The one cell most engine-level tests build by hand: bench "t", `bon`, B 16, N 2, seed 0, R-KV, the PRM scorer.
ONE_CELL = {"benches": ["t"], "methods": ["bon"], "budgets": [16], "ns": [2], "seeds": [0], "evictor": "rkv",
            "models": {}, "scorer": "prm"}


def small_grid(out: Path | None, settings, **fields):
    """`GridOptions` of `ONE_CELL` writing under `out` with `settings` (a `SearchSettings`), `fields` replacing any
    of its axes or setting the rest of the options."""
    from kvrescue.grid import GridOptions

    return GridOptions(**{**ONE_CELL, "settings": settings, "out": out, **fields})


def paper_grid(out: Path | None, models: dict[str, str], **fields):
    """`small_grid` at the paper's cell: MATH500, `kvrescue`, B 64, N 8, batch 8 in bf16, `fields` replacing any."""
    from kvrescue.search import SearchSettings

    return small_grid(out, SearchSettings(batch=8), **{"benches": ["math500"], "methods": ["kvrescue"],
                                                       "budgets": [64], "ns": [8], "models": models,
                                                       "dtype": "bfloat16", **fields})


def small_cell(problems: Iterable = (), method: str = "bon", budget: int | None = 16, n: int = 2):
    """A `Cell` of `problems` (`data.Problem`s) as bench "t", seed 0."""
    from kvrescue.data import ProblemSet
    from kvrescue.cell_plan import Cell

    return Cell(ProblemSet("t", "generic", "t.jsonl", list(problems)), method, budget, n, 0)


def sums(count: int, plus: int = 1, text: str = "") -> list:
    """`count` problems "What is i + `plus`?`text`" (answer i + plus), ids 0..count-1."""
    from kvrescue.data import Problem

    return [Problem(i, f"What is {i} + {plus}?{text}", str(i + plus), {}) for i in range(count)]


def unset_allocator_settings(monkeypatch) -> None:
    """Neither of PyTorch's allocator variables set for this test (each set empty, which PyTorch and
    `cuda_allocator` read as unset), so that what a GPU run's `use_device` sets them to is undone after it."""
    from kvrescue.cuda_allocator import VARIABLES

    for variable in VARIABLES:
        monkeypatch.setenv(variable, "")


def blind_prm(source: Path, target: Path, keep: str) -> Path:
    """A copy of the PRM checkpoint `source` at `target` whose byte-level tokenizer knows only the characters of
    `keep` (and its special tokens): every other character tokenises to nothing (no unknown token, no byte fallback)."""
    import json
    import shutil

    from tokenizers.pre_tokenizers import ByteLevel

    shutil.copytree(source, target)
    known = {c for word, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(keep) for c in word}
    spec = json.loads((target / "tokenizer.json").read_text())
    model = spec["model"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if set(t) <= known}
    model["merges"] = [m for m in model["merges"] if set("".join(m.split(" ") if isinstance(m, str) else m)) <= known]
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


def load_error(stderr: str | bytes) -> str:
    """The one `error:` line of a run refused while its models load: after the run's cell list and its `loading ...`
    line, the last line, and no other line mentioning an error."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    *said, line = text.strip().splitlines()
    assert said and said[-1].startswith("loading ") and not any("error" in s for s in said), text
    assert line.startswith("error: "), text
    return line


def refusal_line(stderr: str | bytes) -> str:
    """The one `error:` line of a refused run: its only line when refused before the run's cell list, else after the
    cell list and loading line (`load_error`)."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    lines = text.strip().splitlines()
    if len(lines) == 1:
        assert lines[0].startswith("error: "), text
        return lines[0]
    return load_error(text)
