"""The progress display's rate and ETA: readable on a slow CPU, from this invocation's own problems."""

from kvrescue import progress
from kvrescue.progress import CellRate, rate


def test_a_slow_rate_is_seconds_per_unit_never_zero():
    assert rate(30, 10.0, "step") == "3.0 step/s"
    assert rate(1, 40.0, "step") == "40.0 s/step"  # what read 0.0 steps/s
    assert rate(0, 40.0, "step") == "- step/s"


def test_the_eta_comes_from_the_problems_this_invocation_finished(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    cell = CellRate(total=10, done=4)  # four were done by an earlier run: they say nothing of this one's speed
    assert cell.fields()["eta"] == "eta after the first problem"
    now[0] += 600.0  # ten minutes for the first problem of this invocation
    cell.in_flight(steps=6, tokens=1100)
    cell.finished(steps=5, tokens=1200)  # the running totals lag the problem just finished: the larger counts
    assert cell.fields() == {"speed": "100.0 s/step 2.0 tok/s", "eta": "eta 0:50:00"}
    for _ in range(5):
        cell.finished(steps=1, tokens=1)
    assert cell.fields()["eta"] == "done"


def test_log_lines_come_when_a_cell_starts_every_so_often_and_when_it_ends(monkeypatch):
    from rich.console import Console

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    console = Console(record=True, width=200)
    lines = progress.LogLines(console, every_s=30.0)
    task = lines.add_task("tiny bon B=16 N=2 seed=0", total=3, completed=0, accuracy="", speed="0.0 step/s", eta="")
    now[0] = 10.0
    lines.update(task, speed="1.0 step/s")  # within 30 s of the last line: nothing
    now[0] = 31.0
    lines.update(task, advance=1, accuracy="acc 100.0%")
    lines.update(task, advance=2, eta="done")  # the last problem: at once
    lines.update(task, speed="2.0 step/s")  # running totals after the end: nothing
    said = [line.split(" ", 1)[1] for line in console.export_text().splitlines()]
    assert said == ["tiny bon B=16 N=2 seed=0: 0/3 problems, 0.0 step/s",
                    "tiny bon B=16 N=2 seed=0: 1/3 problems, acc 100.0%, 1.0 step/s",
                    "tiny bon B=16 N=2 seed=0: 3/3 problems, acc 100.0%, 1.0 step/s, done"]
