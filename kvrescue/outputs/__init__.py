"""Run folders: one per configuration, `<root>/<bench>/<method>-<evictor>-b<budget>-n<N>-s<seed>-<hash8>`, holding
`config.json`, `traces.jsonl` and `summary.json`; every field is described in docs/outputs.md (DESIGN.md section 8).

`records` (RunConfig, Trace and its parts), `folder` (a folder created or resumed under a lock, traces appended),
`run_files` (file names, atomic writes, JSON reads), `traces_file` (traces.jsonl read back, a torn last line
repaired), `config_record` (config.json's record checked, checksums, config diffs), `environment` (what a run
records of its machine), `summary` (summary.json), `decoded` (a decoded problem as a trace).
"""

from kvrescue.outputs.config_record import (
    checked_record, problem_checksum, recorded_shards, recorded_total, same_cell_elsewhere,
)
from kvrescue.outputs.environment import environment, installed_version
from kvrescue.outputs.folder import RunFolder, run_dir
from kvrescue.outputs.run_files import (
    CONFIG, FORMAT, LOCK, SUMMARY, TRACES, RunFolderError, read_json, write_atomic, write_json_atomic,
)
from kvrescue.outputs.traces_file import TornTraceWarning, read_traces
from kvrescue.outputs.records import (
    SOURCES, Candidate, ModelRef, RunConfig, Step, Tokens, Trace,
)
from kvrescue.outputs.summary import DEGENERATE_STEPS, Summary, boxed, busy_seconds, summarize

__all__ = [
    "CONFIG", "DEGENERATE_STEPS", "FORMAT", "LOCK", "SOURCES", "SUMMARY", "TRACES", "Candidate", "ModelRef", "RunConfig", "RunFolder", "RunFolderError", "Step", "Summary", "boxed",
    "Tokens", "TornTraceWarning", "Trace", "busy_seconds", "checked_record", "environment", "installed_version",
    "read_json",
    "read_traces", "run_dir", "same_cell_elsewhere", "summarize", "write_atomic", "write_json_atomic",
]
