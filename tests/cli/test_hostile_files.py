"""A hostile filesystem: links planted under --out, special files where files are read, a full disk. Every case
ends in a one-line error (or a folder listed as unusable) with nothing written outside --out."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
import torch

from kvrescue.outputs import RunFolder, RunFolderError, TornTraceWarning, run_dir
from tests.helpers import KVRESCUE, ROOT, load_error
from tests.outputs.test_outputs import config, trace



def kvrescue(*args: str, cwd: Path, memory: int = 3 << 30, timeout: float = 120,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, with bounded memory (a runaway read fails fast instead of filling the machine) and
    `env` added to the environment."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([KVRESCUE, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          preexec_fn=limit, env={**os.environ, **(env or {})})


def one_line_error(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def planted(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the output root, the run folder a run of `config()` would use, a folder outside the root)."""
    root, outside = tmp_path / "runs", tmp_path / "outside"
    outside.mkdir()
    folder = run_dir(root, config())
    folder.mkdir(parents=True)
    return root, folder, outside


# ---- 1. no write outside --out ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["traces.jsonl", ".lock", "config.json"])
def test_a_dangling_link_in_a_run_folder_is_refused_and_its_target_never_made(tmp_path: Path, name: str) -> None:
    root, folder, outside = planted(tmp_path)
    (folder / name).symlink_to(outside / "received")
    with pytest.raises(RunFolderError, match=f"{name}: is a symbolic link"):
        RunFolder.open(folder, config(), root=root)
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in folder.iterdir()) in ([name], sorted([name, ".lock"]))


def test_a_link_to_an_existing_file_is_never_written_through(tmp_path: Path) -> None:
    root, folder, outside = planted(tmp_path)
    victim = outside / "victim"
    victim.write_text("precious")
    (folder / "traces.jsonl").symlink_to(victim)
    with pytest.raises(RunFolderError, match="symbolic link"):
        RunFolder.open(folder, config(), root=root)
    assert victim.read_text() == "precious"


def test_a_hard_link_in_a_run_folder_is_refused(tmp_path: Path) -> None:
    root, folder, outside = planted(tmp_path)
    RunFolder.open(folder, config(), root=root).close()  # a run to resume
    victim = outside / "victim"
    victim.write_text("")
    (folder / "traces.jsonl").unlink()
    os.link(victim, folder / "traces.jsonl")
    with pytest.raises(RunFolderError, match="2 names"):
        RunFolder.open(folder, config(), root=root)
    assert victim.read_text() == ""


@pytest.mark.parametrize("level", ["bench", "run"])
def test_a_linked_folder_below_the_root_is_refused(tmp_path: Path, level: str) -> None:
    root, outside = tmp_path / "runs", tmp_path / "outside"
    outside.mkdir()
    folder = run_dir(root, config())
    if level == "bench":
        root.mkdir()
        folder.parent.symlink_to(outside)
    else:
        folder.parent.mkdir(parents=True)
        folder.symlink_to(outside)
    for read in (RunFolder.done_in, RunFolder.open):  # the folder read before a run decides to load models, then opened
        with pytest.raises(RunFolderError, match="symbolic link or not a folder"):
            read(folder, config(), root=root)
    assert list(outside.iterdir()) == []


def test_the_summary_is_never_written_through_a_link(tmp_path: Path) -> None:
    root, folder, outside = planted(tmp_path)
    with RunFolder.open(folder, config(), root=root) as run:
        run.append(trace(0))
        (folder / "summary.json").symlink_to(outside / "summary.json")
        with pytest.raises(RunFolderError, match="summary.json: is a symbolic link"):
            run.write_summary()
    assert list(outside.iterdir()) == []


def test_the_root_may_be_the_users_own_link(tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "runs").symlink_to(real)
    folder = run_dir(tmp_path / "runs", config())
    with RunFolder.open(folder, config(), root=tmp_path / "runs") as run:
        run.append(trace(0))
    assert (real / folder.relative_to(tmp_path / "runs") / "traces.jsonl").is_file()


@pytest.mark.parametrize("command", ["grade", "view", "report --plot"])
def test_an_output_file_that_is_a_link_or_a_fifo_is_refused(tmp_path: Path, command: str) -> None:
    root, folder, outside = planted(tmp_path)
    with RunFolder.open(folder, config(), root=root) as run:
        run.append(trace(0))
        run.write_summary()
    (tmp_path / "in.jsonl").write_text(json.dumps({"output": "\\boxed{1}", "gt": "1"}) + "\n")
    name = "out.png" if command == "report --plot" else "out"
    (tmp_path / name).symlink_to(outside / "received")
    os.mkfifo(tmp_path / "fifo.png")
    args = {"grade": ["grade", "in.jsonl", "--bench", "gsm8k", "--out"], "view": ["view", "runs", "--out"],
            "report --plot": ["report", "runs", "--plot"]}[command]
    for target, kind in ((name, "a symbolic link"), ("fifo.png", "a FIFO")):
        assert f"{target}: is {kind}" in one_line_error(kvrescue(*args, target, cwd=tmp_path, timeout=60))
    assert list(outside.iterdir()) == []


# ---- 2. special files where files are read -------------------------------------------------------------------

def test_report_and_view_list_a_folder_of_special_files_as_unusable_and_go_on(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    good = run_dir(root, config())
    with RunFolder.open(good, config(), root=root) as run:
        run.append(trace(0))
        run.write_summary()
    zero, fifo = root / "math500" / "zero", root / "math500" / "fifo"
    zero.mkdir()
    (zero / "config.json").write_bytes((good / "config.json").read_bytes())
    (zero / "traces.jsonl").symlink_to("/dev/zero")
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    done = kvrescue("report", "runs", "--format", "json", cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    notes = {p["path"]: p["message"] for p in orjson.loads(done.stdout)["problems"]}
    assert "traces.jsonl: is a character device" in notes[str(Path("runs") / "math500" / "zero")]
    assert "config.json: is a FIFO" in notes[str(Path("runs") / "math500" / "fifo")]
    done = kvrescue("view", "runs", "-o", "page.html", cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "is a FIFO" in done.stderr and "is a character device" in done.stderr, done.stderr


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_cost_refuses_a_model_config_that_is_a_special_file(tmp_path: Path, special: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if special == "fifo":
        os.mkfifo(model / "config.json")
    else:
        (model / "config.json").symlink_to(special)
    line = one_line_error(kvrescue("cost", "--base", "model", "--helper", "model", cwd=tmp_path, timeout=60))
    assert "config.json: is a " in line and "not a regular file" in line


def test_a_resumed_run_refuses_a_special_config(tmp_path: Path) -> None:
    root, folder, _ = planted(tmp_path)
    os.mkfifo(folder / "config.json")
    with pytest.raises(RunFolderError, match="config.json: is a FIFO"):
        RunFolder.open(folder, config())


def test_grade_refuses_a_fifo_and_proc_mem_in_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.jsonl")
    assert "fifo.jsonl: is a FIFO, not a JSONL file" in one_line_error(
        kvrescue("grade", "fifo.jsonl", "--bench", "gsm8k", cwd=tmp_path, timeout=60))
    assert "/proc/self/mem: cannot read" in one_line_error(
        kvrescue("grade", "/proc/self/mem", "--bench", "gsm8k", cwd=tmp_path, timeout=60))


def test_load_model_refuses_a_special_file_in_a_model_folder(tmp_path: Path, qwen2_dir: Path) -> None:
    from kvrescue.engine.loader import ModelLoadError, load_model, load_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    for f in qwen2_dir.iterdir():
        (model / f.name).symlink_to(f)  # the Hugging Face cache is links to regular files: fine
    load_tokenizer(model)
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelLoadError, match="tokenizer.json: is a FIFO"):
            load(model)


class _Opens:
    """Unpickled, it would create the file it names (pickle calls `open(path, "w")`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_pytorch_weight_file_that_would_run_code_is_refused_unrun(tmp_path: Path, qwen2_dir: Path) -> None:
    """Weight files are untrusted: a pytorch_model.bin is unpickled with weights_only (tensors only), so one that
    calls a function when loaded is a one-line load error, and the function never runs."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from kvrescue.engine.loader import ModelLoadError, load_model

    model = shutil.copytree(qwen2_dir, tmp_path / "model")
    marker = tmp_path / "ran"
    torch.save({**load_file(model / "model.safetensors"), "x": _Opens(marker)}, model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(model)
    assert "pytorch_model.bin is not a readable PyTorch weight file (UnpicklingError" in str(e.value)
    assert "\n" not in str(e.value) and not marker.exists()
    torch.save([1, 2], model / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin holds no state dict"):
        load_model(model)


# ---- 4. a full disk during a run -----------------------------------------------------------------------------

FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from kvrescue.outputs import RunFolder, RunFolderError
    from tests.outputs.test_outputs import config, trace
    folder = Path(sys.argv[1])
    run = RunFolder.open(folder, config())
    run.append(trace(0))
    size = (folder / "traces.jsonl").stat().st_size
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for room, action in ((size + 100, lambda: run.append(trace(1, sources="b" * 50))), (100, run.write_summary)):
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.RLIM_INFINITY))  # the next write does not fit
        try:
            action()
        except RunFolderError as e:
            print(e)
""")


def test_a_full_disk_is_a_one_line_error_and_keeps_the_finished_problems(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(folder)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    append, summary = done.stdout.strip().splitlines()
    assert append.startswith(f"{folder / 'traces.jsonl'}: cannot write (File too large)") and "resume" in append
    assert summary.startswith(f"{folder / 'summary.json'}: cannot write (File too large)")
    with pytest.warns(TornTraceWarning), RunFolder.open(folder, config()) as run:  # the torn line is cut
        assert [t.idx for t in run.traces] == [0]
    assert not list(folder.glob(".*.tmp"))


def test_a_full_disk_stops_kvrescue_run_with_one_line(tmp_path: Path, qwen2_dir: Path) -> None:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n"
                                              for i in range(3)))

    def small_disk() -> None:  # files stop growing at 6 kB: config.json fits, the traces soon do not
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, resource.RLIM_INFINITY))

    done = subprocess.run([KVRESCUE, "run", "--bench", "p.jsonl", "--base", str(qwen2_dir), "--helper", str(qwen2_dir),
                           "--prm", "helper-loglik", "--method", "bon", "--n", "2", "--budget", "16", "--device", "cpu",
                           "--max-step-tokens", "40", "--max-steps", "6", "--out", "out"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600, preexec_fn=small_disk)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr  # above it: the progress bar
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "traces.jsonl: cannot write (File too large); the problems finished " \
        "before are kept" in last
    lock = subprocess.run(["git", "rev-parse", "--git-path", "index.lock"], capture_output=True, text=True, cwd=ROOT)
    assert not (ROOT / lock.stdout.strip()).exists()  # recording the git state wrote nothing (no torn index.lock)



# ---- 5. bounded model files ---------------------------------------------------------------------------------------

def gguf_metadata_bomb(path: Path, strings: int) -> Path:
    """A sparse GGUF file whose one metadata key is an array of `strings` empty strings (8 zero bytes each)."""
    key = b"tokenizer.ggml.tokens"
    head = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, strings))
    with path.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + 8 * strings)
    return path


def test_a_gguf_metadata_bomb_is_refused_before_it_is_read(tmp_path: Path) -> None:
    gguf_metadata_bomb(tmp_path / "bomb.gguf", 5_000_000)  # 40 MB on disk, gigabytes in gguf-py's reader
    (tmp_path / "p.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    done = kvrescue("run", "--bench", "p.jsonl", "--base", "bomb.gguf", "--helper", "bomb.gguf", "--prm",
                    "helper-loglik", "--method", "bon", "--device", "cpu", "--out", "out", cwd=tmp_path, memory=2 << 30)
    assert done.returncode == 2
    line = load_error(done.stderr)
    assert "bomb.gguf" in line and "more than 2097152 elements" in line


def test_a_chat_template_that_fills_memory_is_one_line_naming_the_model(tmp_path: Path, qwen2_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(qwen2_dir, model)
    (model / "chat_template.jinja").write_text("{{ 'x' * 20000000000 }}")
    (tmp_path / "p.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    done = kvrescue("run", "--bench", "p.jsonl", "--base", "model", "--helper", "model", "--prm", "helper-loglik",
                    "--method", "bon", "--n", "2", "--budget", "16", "--device", "cpu", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "error: model: its chat template failed (MemoryError: )"


def test_a_model_whose_logits_are_nan_ends_each_problem_with_a_recorded_reason(tmp_path: Path, qwen2_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(qwen2_dir, model)
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "p.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    done = kvrescue("run", "--bench", "p.jsonl", "--base", "model", "--helper", str(qwen2_dir), "--prm",
                    "helper-loglik", "--method", "bon", "--n", "2", "--budget", "16", "--device", "cpu", "--out", "out",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (traces,) = [folder / "traces.jsonl" for folder in (tmp_path / "out" / "p").iterdir()]
    for trace in map(orjson.loads, traces.read_bytes().splitlines()):
        assert trace["stop"] == "non-finite" and trace["n_steps"] == 1
        assert {c["finish"] for c in trace["candidates"][0]} == {"non-finite"}
