"""config.json's record of a run folder: its `run` and `problems` fields checked, the shards and totals they record,
problem checksums, and the fields by which two configurations differ."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import orjson

from kvrescue.outputs.records import RunConfig
from kvrescue.outputs.run_files import CONFIG, RunFolderError, read_json


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


def config_diff(old: Any, new: dict[str, Any]) -> str:
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
            notes.append(f"{other} holds this cell with other settings ({config_diff(stored['config'], config.to_dict())}); "
                         f"it is left as it is and this run starts in {path.name}")
    return notes
