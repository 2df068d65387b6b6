"""Hand-edited and hostile content: exact big integers, hand-edited run folders (unusable, never fatal), mangled
checkpoints, environment variables and labels. Each ends in a one-line error or a note, never a traceback."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.data import load_problems
from kvrescue.outputs import ModelRef, RunConfig, RunFolder, RunFolderError, run_dir
from tests.cli.test_hostile_files import kvrescue, one_line_error
from tests.outputs.test_outputs import config, trace

BIG = 123456789012345678901234567890


# ---- 3. integers beyond 64 bits pass through exactly ----------------------------------------------------------

def test_grade_keeps_big_integers_exactly_and_compares_them_as_written(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(
        f'{{"output": "so \\\\boxed{{{BIG}}}", "gt": {BIG}, "meta": {{"id": {-BIG}, "n": [{2 ** 64}, 1.5]}}}}\n'
        f'{{"output": "so \\\\boxed{{{BIG + 1}}}", "gt": {BIG}}}\n')
    done = kvrescue("grade", "in.jsonl", "--bench", "gsm8k", "--out", "out.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())
    assert first["gt"] == BIG and first["meta"] == {"id": -BIG, "n": [2 ** 64, 1.5]}
    assert first["gt_norm"] == str(BIG) and first["pred"] == str(BIG) and first["correct"] is True
    # the grader gets the answer's text: not `1.2345678901234568e+29` (its numeric test still has rel_tol 1e-4)
    assert second["gt_norm"] == str(BIG) and second["pred"] == str(BIG + 1)
    assert f'"gt":{BIG},' in (tmp_path / "out.jsonl").read_text()


def test_a_problem_files_big_integer_answer_reaches_the_trace_as_written(tmp_path: Path) -> None:
    (tmp_path / "set.jsonl").write_text(f'{{"question": "q", "answer": {BIG}}}\n')
    (problem,) = load_problems(str(tmp_path / "set.jsonl")).problems
    assert problem.gt == str(BIG)


def test_grade_refuses_a_record_nested_deeper_than_it_can_write_before_grading(tmp_path: Path) -> None:
    deep = "[" * 300 + "]" * 300
    (tmp_path / "in.jsonl").write_text('{"output": "\\\\boxed{1}", "gt": "1"}\n'
                                       f'{{"output": "\\\\boxed{{1}}", "gt": "1", "x": {deep}}}\n')
    line = one_line_error(kvrescue("grade", "in.jsonl", "--bench", "gsm8k", cwd=tmp_path))
    assert "in.jsonl:2: nested deeper than 254 levels" in line


# ---- 4. one-line errors for options, environment and mangled checkpoints ----------------------------------------

def test_grade_timeout_beyond_a_day_is_refused(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"output": "\\\\boxed{x^2}", "gt": "x*x"}\n')
    line = one_line_error(kvrescue("grade", "in.jsonl", "--bench", "math500", "--timeout", "3e6", cwd=tmp_path))
    assert "--timeout 3000000.0: need a positive number of seconds, at most 86400" in line


def test_grade_starts_no_more_workers_than_requests(tmp_path: Path) -> None:
    from grader import _pool, grade_many, shutdown

    shutdown()  # the pool is the process's: workers earlier tests started would stay counted
    grade_many([("\\boxed{x^2}", "x*x", "math500")], workers=6, timeout=30.0)
    assert len(_pool._slots) == 1


def write_config(folder: Path, **fields) -> Path:
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, **fields}))
    return folder


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": -64}, "hidden_size = -64: need an integer from 1 to 1048576"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0: need an integer"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads = 3"),
    ({"hidden_size": 10 ** 9}, "hidden_size = 1000000000: need an integer from 1 to 1048576"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers = '2': need an integer"),
])
def test_cost_refuses_a_mangled_checkpoint_config(tmp_path: Path, fields: dict, message: str) -> None:
    write_config(tmp_path, **fields)
    assert message in one_line_error(kvrescue("cost", "--base", ".", "--helper", ".", cwd=tmp_path, timeout=60))


def test_cost_of_the_largest_config_and_options_writes_exact_counts(tmp_path: Path) -> None:
    write_config(tmp_path, vocab_size=1 << 24, hidden_size=1 << 20, intermediate_size=1 << 22, num_hidden_layers=1 << 12,
                 num_attention_heads=1 << 12, num_key_value_heads=1 << 12, head_dim=1 << 12, torch_dtype="float32")
    done = kvrescue("cost", "--base", ".", "--helper", ".", "--format", "json", "--batch", str(1 << 20), "--n",
                    str(1 << 10), "--context", str(1 << 24), "--budget", str(1 << 24), cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    devices = json.loads(done.stdout)["devices"]
    assert max(d["kv_bytes"] for d in devices) > 1 << 64 and all(isinstance(d["kv_bytes"], int) for d in devices)


def test_a_deeply_nested_tokenizer_json_is_a_load_error(tmp_path: Path, qwen2_dir: Path) -> None:
    from kvrescue.engine.loader import ModelLoadError, load_tokenizer

    for f in qwen2_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    tokenizer = json.loads((qwen2_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ModelLoadError, match="the tokenizer in .* could not be read"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("content", [os.urandom(4096), b"GGUF" + struct.pack("<I", 3) + b"\x01"])
def test_a_mangled_gguf_file_is_a_load_error(tmp_path: Path, content: bytes) -> None:
    from kvrescue.engine.loader import ModelLoadError, load_model

    (tmp_path / "m.gguf").write_bytes(content)
    with pytest.raises(ModelLoadError, match="m.gguf'?: not a readable GGUF file"):
        load_model(tmp_path / "m.gguf")


def test_a_bad_progress_interval_is_a_one_line_error(tmp_path: Path) -> None:
    done = kvrescue("run", "--preset", "cpu-demo", "--limit", "1", "--out", "runs", cwd=tmp_path,
                    env={"KVRESCUE_PROGRESS_EVERY_S": "abc"})
    assert "$KVRESCUE_PROGRESS_EVERY_S='abc': need a number of seconds >= 0" in one_line_error(done)
    assert not (tmp_path / "runs").exists()


def test_a_cache_folder_that_is_a_device_is_a_one_line_error(tmp_path: Path) -> None:
    done = kvrescue("run", "--preset", "cpu-demo", "--limit", "1", "--out", "runs", cwd=tmp_path,
                    env={"KVRESCUE_CACHE": "/dev/null"})
    assert "--preset cpu-demo: cache folder /dev/null ($KVRESCUE_CACHE): cannot use it" in one_line_error(done)


# ---- 4. hand-edited run folders: unusable with the reason, never fatal; resuming refuses them -----------------

def edit_config(folder: Path, edit) -> None:
    stored = json.loads((folder / "config.json").read_text())
    edit(stored)
    (folder / "config.json").write_text(json.dumps(stored))


def edit_trace(folder: Path, edit) -> None:
    record = json.loads((folder / "traces.jsonl").read_text())
    edit(record)
    (folder / "traces.jsonl").write_text(json.dumps(record) + "\n")


EDITS = {
    "bench_a_number": (edit_config, lambda c: c["config"].update(bench=5), "bench is 5, not str"),
    "n_a_list": (edit_config, lambda c: c["config"].update(n=[8]), "n is [8], not int"),
    "detector_a_string": (edit_config, lambda c: c["config"]["settings"].update(detector="on"),
                          "settings.detector is 'on'"),
    "total_a_word": (edit_config, lambda c: c["run"].update(total="many"), "run.total is 'many'"),
    "shard_a_number": (edit_config, lambda c: c["run"].update(shard=5), "run.shard is 5"),
    "shards_malformed": (edit_config, lambda c: c["run"].update(shards={"x": 1}), "run.shards is {'x': 1}"),
    "problems_key_a_word": (edit_config, lambda c: c.update(problems={"first": "abc"}), "problems is {'first'"),
    "correct_a_word": (edit_trace, lambda t: t.update(correct="yes"), "corrupt traces line"),
    "tokens_a_word": (edit_trace, lambda t: t["tokens"].update(base="x"), "corrupt traces line"),
    "idx_a_string": (edit_trace, lambda t: t.update(idx="0"), "corrupt traces line"),
}


def good_and_edited(root: Path, case: str) -> tuple[Path, Path]:
    """A finished run folder, and another one (seed 1) edited by hand as `case` says."""
    folders = []
    for seed in (0, 1):
        cfg = config(seed=seed)
        with RunFolder.open(run_dir(root, cfg), cfg, total=1) as run:
            run.append(trace(0))
            run.write_summary()
        folders.append(run_dir(root, cfg))
    edit, change, _ = EDITS[case]
    edit(folders[1], change)
    return folders[0], folders[1]


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_hand_edited_folder_is_listed_as_unusable_and_the_rest_reported(tmp_path: Path, case: str) -> None:
    good, bad = good_and_edited(tmp_path / "runs", case)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = orjson.loads(result.stdout)
    notes = {p["path"]: p["message"] for p in data["problems"]}
    assert notes[str(bad)].startswith("unusable run folder") and EDITS[case][2] in notes[str(bad)]
    assert [row[0] for row in next(t for t in data["tables"] if t["name"] == "runs")["rows"]] == [str(good)]


@pytest.mark.parametrize("case", ["bench_a_number", "correct_a_word", "total_a_word"])
def test_view_lists_a_hand_edited_folder_and_shows_the_rest(tmp_path: Path, case: str) -> None:
    good_and_edited(tmp_path / "runs", case)
    result = CliRunner().invoke(app, ["view", str(tmp_path / "runs"), "-o", str(tmp_path / "page.html")])
    assert result.exit_code == 0 and "unusable run folder" in result.stderr and "1 runs" in result.stderr, result.output


@pytest.mark.parametrize("case", ["total_a_word", "shard_a_number", "shards_malformed", "problems_key_a_word",
                                  "correct_a_word"])
def test_resuming_a_hand_edited_folder_is_a_one_line_error(tmp_path: Path, case: str) -> None:
    _, bad = good_and_edited(tmp_path / "runs", case)
    with pytest.raises(RunFolderError, match=EDITS[case][2].split(" is")[0].replace(".", r"\.") + "|traces.jsonl:1"):
        RunFolder.open(bad, config(seed=1), problems={0: "abc"})


# ---- 5. labels are plain text ---------------------------------------------------------------------------------

def test_a_dollar_in_a_model_id_is_plotted_as_text(tmp_path: Path) -> None:
    for base, evictor in ((r"org/$\frac{x$", "rkv"), ("org/plain", r"$\frac{y$")):  # labels name both
        models = {"base": ModelRef(base), "helper": ModelRef("h"), "prm": ModelRef("p")}
        cfg = RunConfig("math500", "bon", 64, 8, evictor, 0, models, "prm", settings={"detector": None})
        with RunFolder.open(run_dir(tmp_path / "runs", cfg), cfg, total=1) as run:
            run.append(trace(0))
            run.write_summary()
    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--plot", str(tmp_path / "plot.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = CliRunner().invoke(app, ["view", str(tmp_path / "runs"), "-o", str(tmp_path / "page.html")])
    assert result.exit_code == 0, result.output
