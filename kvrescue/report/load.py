"""Reading run folders back for the report: finding them, loading traces, merging shards, leaving out copies."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from kvrescue.errors import InputError
from kvrescue.methods import METHODS
from kvrescue.shapes import BUFFER
from kvrescue.outputs import (
    CONFIG, SUMMARY, TRACES, RunConfig, RunFolderError, Summary, Trace, checked_record, read_json, read_traces,
    recorded_shards, recorded_total, summarize,
)


class ReportError(InputError):
    """Nothing to report on; the message is one line."""


@dataclass
class Run:
    """One run folder, read back."""

    path: Path
    config: RunConfig
    traces: list[Trace]
    summary: Summary
    in_progress: str | None  # why it is not finished, or None
    shard: tuple[int, int] | None = None  # (i, k) of a `--shard i/k` run, or None

    @property
    def base(self) -> str | None:
        return self.config.models["base"].id if "base" in self.config.models else None

    @property
    def helper(self) -> str | None:
        return self.config.models["helper"].id if "helper" in self.config.models else None

    @property
    def prm_format(self) -> str | None:
        """The PRM's input recipe (`--prm-format` of the qwen-math recipe, else `--prm-recipe`); None without a PRM,
        and in runs recorded before the option (they used the model card's)."""
        return self.config.settings.get("prm_format") or self.config.settings.get("prm_recipe")

    @property
    def setup(self) -> tuple[str, str | None]:
        """What every compared run must share: the scorer (and PRM model, with its input recipe)."""
        prm = self.config.models.get("prm")
        if prm is None:
            return self.config.scorer, None
        return self.config.scorer, prm.id + (f", {self.prm_format} recipe" if self.prm_format else "")

    @property
    def evictor(self) -> str:
        """The evictor, with its parameters when not its defaults and R-KV's buffer W when not the default (runs at
        other settings are other rows)."""
        buffer, params = self.config.settings.get("buffer"), self.config.settings.get("evictor_params") or {}
        return (self.config.evictor + "".join(f", {k}={v}" for k, v in params.items())
                + (f", W={buffer}" if buffer not in (None, BUFFER) else ""))

    @property
    def row(self) -> RowKey:
        c = self.config
        spec = METHODS[c.method]
        return RowKey(c.bench_name(), c.method, self.evictor, c.n, c.budget, self.base if spec.base else None,
                      self.helper if spec.helper else None)


@dataclass(frozen=True)
class RowKey:
    """A configuration without its seed; `bench` is the bench's name (a JSONL path's file stem)."""

    bench: str
    method: str
    evictor: str
    n: int
    budget: int | None
    base: str | None
    helper: str | None


@dataclass
class FolderNote:
    """A folder that could not be used, or a caveat about one."""

    path: str
    message: str


def find_run_folders(paths: Iterable[Path | str]) -> tuple[list[Path], list[FolderNote]]:
    """Run folders among `paths` (a run folder, or any folder above some)."""
    found: list[Path] = []
    notes: list[FolderNote] = []
    for p in map(Path, paths):
        if not p.exists():
            notes.append(FolderNote(str(p), "no such file or folder"))
        elif not p.is_dir():
            notes.append(FolderNote(str(p), "not a folder (give run folders or folders above them)"))
        elif (p / CONFIG).exists() or (p / TRACES).exists():
            found.append(p)
        else:
            below = sorted({q.parent for pattern in (CONFIG, TRACES) for q in p.rglob(pattern)})
            if below:
                found += below
            else:
                notes.append(FolderNote(str(p), "no run folders here (no config.json or traces.jsonl below it)"))
    return list(dict.fromkeys(found)), notes


def load_run(path: Path) -> tuple[Run | None, list[FolderNote]]:
    """Read one run folder without modifying it; what is wrong with it is returned, not raised."""
    notes: list[FolderNote] = []
    try:
        stored = read_json(path / CONFIG)
        run_meta = checked_record(stored, path / CONFIG)[0]
        config = RunConfig.from_dict(stored["config"])
    except RunFolderError as e:
        return None, [FolderNote(str(path), f"unusable run folder: {e}")]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return None, [FolderNote(str(path), f"unusable run folder: {path / CONFIG} is not a kvrescue config ({e})")]
    if config.method not in METHODS:
        return None, [FolderNote(str(path), f"unusable run folder: unknown method {config.method!r} in {path / CONFIG}")]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traces = read_traces(path / TRACES)
    except RunFolderError as e:
        return None, [FolderNote(str(path), f"unusable run folder: {e}")]
    notes += [FolderNote(str(path), str(w.message)) for w in caught]
    if not traces:
        return None, notes + [FolderNote(str(path), "no finished problems yet (traces.jsonl empty or missing)")]
    total = recorded_total(run_meta)
    summary = summarize(traces, config, total)
    in_progress = _missing_shards(run_meta) or _unfinished(path, summary, total)
    if in_progress:
        notes.append(FolderNote(str(path), f"in progress: {in_progress}"))
    shard = None if len(recorded_shards(run_meta)) > 1 else run_meta.get("shard")
    return Run(path, config, traces, summary, in_progress, tuple(shard) if shard else None), notes


def _unfinished(path: Path, summary: Summary, total: int | None) -> str | None:
    """Why the folder's run looks unfinished, or None."""
    if not (path / SUMMARY).exists():
        return f"no summary.json: running or interrupted ({summary.problems} problems so far)"
    if total is not None and summary.problems < total:
        return f"{summary.problems} of {total} problems"
    try:
        stored = read_json(path / SUMMARY)
    except RunFolderError:
        stored = None
    written = stored.get("problems") if isinstance(stored, dict) else None
    if written != summary.problems:
        return f"summary.json is stale ({written} problems, traces hold {summary.problems})"
    return None


def _missing_shards(run_meta: dict[str, Any]) -> str | None:
    """For a folder that several `--shard i/k` runs wrote one after the other: the shards not run yet."""
    shards = recorded_shards(run_meta)
    if len(shards) < 2:
        return None
    k = int(run_meta["shard"][1])
    missing = sorted(set(range(k)) - {int(key.split("/")[0]) for key in shards if key.endswith(f"/{k}")})
    return f"shards {', '.join(f'{i}/{k}' for i in missing)} missing" if missing else None


def merge_shards(runs: list[Run]) -> tuple[list[Run], list[FolderNote]]:
    """Shards of one configuration (same identity, `--shard i/k` with the same k) become one run.

    The merged run holds the union of the shards' traces (an idx recorded twice counts once), its total
    is the sum of the shards' totals, and it is in progress while a shard is missing or unfinished.
    A second folder of the same shard is left as it is (the duplicate check reports it).
    """
    merged: list[Run] = []
    notes: list[FolderNote] = []
    groups: dict[tuple[str, int], dict[tuple[int, int], Run]] = {}
    for run in runs:
        if run.shard is None or run.shard in groups.setdefault((run.config.digest(), run.shard[1]), {}):
            merged.append(run)
        else:
            groups[(run.config.digest(), run.shard[1])][run.shard] = run
    for (_, k), shards in groups.items():
        parts = [shards[key] for key in sorted(shards)]
        if len(parts) == 1 and k == 1:
            merged.append(parts[0])
            continue
        traces = list({t.idx: t for part in reversed(parts) for t in part.traces}.values())
        totals = [part.summary.total for part in parts]
        total = None if None in totals else sum(totals)
        summary = summarize(traces, parts[0].config, total)
        missing = sorted(set(range(k)) - {i for i, _ in shards})
        waiting = [f"shard {part.shard[0]}/{k}: {part.in_progress}" for part in parts if part.in_progress]
        if missing:
            waiting.insert(0, f"shards {', '.join(f'{i}/{k}' for i in missing)} missing")
        run = Run(parts[0].path, parts[0].config, traces, summary, "; ".join(waiting) or None, None)
        merged.append(run)
        notes.append(FolderNote(str(run.path), f"merged {len(parts)} of {k} shards: " +
                             ", ".join(f"{part.shard[0]}/{k} {part.path}" for part in parts)))
    return merged, notes


def load_runs(paths: Iterable[Path | str]) -> tuple[list[Run], list[FolderNote]]:
    """All usable runs under `paths`, and every problem met. Raises ReportError when none is usable."""
    folders, folder_notes = find_run_folders(paths)
    runs: list[Run] = []
    for folder in folders:
        run, notes = load_run(folder)
        folder_notes += notes
        if run is not None:
            runs.append(run)
    runs, notes = merge_shards(runs)
    folder_notes += notes
    seen: dict[tuple[Any, ...], Run] = {}
    unique: list[Run] = []
    for run in runs:
        key = (run.setup, run.row, run.config.seed)
        if key in seen:
            same = seen[key].config.digest() == run.config.digest()
            folder_notes.append(FolderNote(str(run.path), f"{'a copy of' if same else 'same bench, method, N, budget and seed as'} "
                                    f"{seen[key].path}{'' if same else ' with other settings'}; left out"))
            continue
        seen[key] = run
        unique.append(run)
    if not unique:
        detail = "; ".join(f"{p.path}: {p.message}" for p in folder_notes) or "nothing given"
        raise ReportError(f"no usable run folders ({detail})")
    return unique, folder_notes
