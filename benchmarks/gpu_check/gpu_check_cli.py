"""`kvrescue` as a user types it, for gpu_check's `e2e` section: `python benchmarks/gpu_check/gpu_check_cli.py run ...` runs the
CLI in this process with the user's arguments and, at its end (also when it fails or is interrupted), writes to the
file named by $GPU_CHECK_MEASURES what the run itself does not record: its memory plan (the largest cell at the batch
it ran, as `run --plan` computes it), the GPU's peak allocated and reserved bytes, and how many models it loaded. An
instrument on the benchmark side: it wraps `runs.run_grid` and `group_models.load_model` to see the options and the loads,
and changes nothing they do."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvrescue.cli import app

MEASURES = "GPU_CHECK_MEASURES"


def watch_runs(seen: dict) -> None:
    """Wrap `runs.run_grid` and `group_models.load_model` to record into `seen` the options and the loads."""
    from kvrescue import group_models
    import kvrescue.runs as runs

    run_grid, load_model = runs.run_grid, group_models.load_model

    def run_grid_seen(options, *args, **kwargs):
        seen["options"] = options
        return run_grid(options, *args, **kwargs)

    def load_model_seen(*args, **kwargs):
        seen["models_loaded"] += 1
        return load_model(*args, **kwargs)

    runs.run_grid, group_models.load_model = run_grid_seen, load_model_seen


def main() -> None:
    seen: dict = {"options": None, "models_loaded": 0}
    if sys.argv[1:2] == ["run"]:  # report and view load nothing: they start without torch, as the console script does
        watch_runs(seen)
    sys.argv[0] = "kvrescue"
    try:
        app()
    finally:
        options = seen["options"]
        plan = None
        if options is not None:
            from kvrescue.device_plan import plan_for_device
            plan = plan_for_device(options.group_plan(), options.devices[0])
        measures = {"models_loaded": seen["models_loaded"],
                    "batch": options.settings.batch if options is not None else None,
                    "planned_bytes": plan.total if plan is not None else None}
        torch = sys.modules.get("torch")  # imported by a run
        if torch is not None and torch.cuda.is_initialized():
            measures.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                            peak_reserved_bytes=torch.cuda.max_memory_reserved())
        Path(os.environ[MEASURES]).write_text(json.dumps(measures))


if __name__ == "__main__":
    main()
