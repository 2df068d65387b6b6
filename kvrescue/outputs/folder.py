"""A run folder's lifecycle: created or resumed under a lock, traces appended and fsync'd, the summary written."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import orjson

from kvrescue.files import CONFIG_LIMIT, OutputFolder
from kvrescue.outputs.config_record import (
    checked_record, config_diff, problem_checksum, recorded_shards, recorded_total,
)
from kvrescue.outputs.environment import environment
from kvrescue.outputs.records import RunConfig, Trace
from kvrescue.outputs.run_files import (
    CONFIG, FORMAT, LOCK, SUMMARY, TRACES, RunFolderError, json_bytes, parse_json,
)
from kvrescue.outputs.summary import Summary, summarize
from kvrescue.outputs.traces_file import TornTraceWarning, parse_traces, repair_traces


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


def run_dir(root: Path | str, config: RunConfig) -> Path:
    """The deterministic folder of `config` under `root`."""
    return Path(root) / config.bench_name() / config.folder_name()


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
                repair_traces(folder, len(data), tail)
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
            diff = config_diff(stored.get("config"), config.to_dict())
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
