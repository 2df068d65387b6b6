"""What the commands say and where: products on stdout (report, bench, cost), small messages that must not mislead,
and the options users of lm-eval and vLLM reach for first (`--version`, `-h`)."""

from dataclasses import replace
from importlib.metadata import version

import orjson
import pytest

from kvrescue.errors import InputError
from tests.helpers import kvrescue, kvrescue_run, ok, paper_grid, write_jsonl, write_run


def test_version_and_short_help():
    assert ok(kvrescue("--version")).stdout.decode() == f"kvrescue {version('kvrescue')}\n"
    for args in (["-h"], ["run", "-h"], ["report", "-h"]):
        assert b"Usage: " in ok(kvrescue(*args)).stdout  # (CliRunner names the program "root")


def test_bench_prints_its_table_and_json_on_stdout():
    table = ok(kvrescue("bench"))
    assert b"gsm8k" in table.stdout and table.stderr == b""
    rows = orjson.loads(ok(kvrescue("bench", "--format", "json")).stdout)
    assert {row["bench"]: row["problems"] for row in rows}["gsm8k"] == 1319
    assert set(rows[0]) == {"bench", "problems", "problem_field", "licence", "source"}


def test_cost_prints_its_table_on_stdout(qwen2_dir):
    done = ok(kvrescue("cost", "--base", str(qwen2_dir), "--helper", str(qwen2_dir)))
    assert b"KV per token" in done.stdout and done.stderr == b""


@pytest.fixture(scope="module")
def a_run(tmp_path_factory):
    from kvrescue.outputs import RunConfig, Trace

    root = tmp_path_factory.mktemp("runs")
    config = RunConfig(bench="gsm8k", method="bon", budget=16, n=2, evictor="rkv", seed=0, models={}, scorer="prm")
    write_run(root, config, [Trace.skipped(0, "1 + 1?", "2", "2", "too long")])
    return root


def test_report_prints_its_tables_on_stdout_and_a_plot_that_cannot_be_written_stops_it_first(a_run):
    done = ok(kvrescue("report", str(a_run)))
    assert b"Accuracy" in done.stdout and b"Accuracy" not in done.stderr
    failed = kvrescue("report", str(a_run), "--plot", "/proc/kvrescue-plot.png")
    assert failed.returncode == 2 and failed.stdout == b""
    (line,) = failed.stderr.decode().splitlines()
    assert line.startswith("error: /proc/kvrescue-plot.png: ")


def test_a_bench_path_that_does_not_exist_is_no_such_file(tmp_path):
    done = kvrescue_run("--bench", str(tmp_path / "nope.jsonl"))
    assert done.returncode == 2
    assert done.stderr.decode() == f"error: {tmp_path / 'nope.jsonl'}: no such file\n"
    assert "unknown benchmark 'nope'" in kvrescue_run("--bench", "nope").stderr.decode()


def test_device_memory_needs_a_unit():
    done = kvrescue_run("--plan", "--device-memory", "80", "--devices", "cuda:0")
    assert done.returncode == 2 and "--device-memory '80': expected a size with its unit" in done.stderr.decode()


def test_the_dtype_is_recorded_by_its_full_name(problems, qwen2_dir, prm_dir, tmp_path):
    ok(kvrescue_run("--bench", str(problems), "--limit", "1", "--method", "bon", "--n", "1", "--max-steps", "1",
                    "--max-step-tokens", "4", "--base", str(qwen2_dir), "--prm", str(prm_dir), "--device", "cpu",
                    "--dtype", "fp32", "--out", str(tmp_path)))
    (config,) = tmp_path.glob("tiny/*/config.json")
    assert orjson.loads(config.read_bytes())["config"]["settings"]["dtype"] == "float32"


@pytest.mark.parametrize("command", [["grade", "--bench", "generic", "-o"], ["view", "-o"]])
def test_an_output_that_cannot_be_written_is_named_as_the_user_gave_it(command, a_run, tmp_path):
    records = write_jsonl(tmp_path / "in.jsonl", [{"output": "\\boxed{2}", "gt": "2"}])
    target = "/proc/kvrescue-out"
    args = [*command[:-1], str(records) if command[0] == "grade" else str(a_run), command[-1], target]
    done = kvrescue(*args)
    assert done.returncode == 2
    (line,) = done.stderr.decode().splitlines()
    assert line.startswith(f"error: {target}: ") and ".tmp" not in line


def test_grading_nothing_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    done = kvrescue("grade", str(empty), "--bench", "gsm8k")
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode() == f"error: {empty}: no records to grade (an empty input)\n"


def test_the_memory_refusal_at_batch_1_does_not_say_lower_the_batch(tmp_path):
    from kvrescue.device_plan import refuse_what_does_not_fit

    models = {}
    for role in ("base", "helper", "prm"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_bytes(orjson.dumps(
            {"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064}))
        models[role] = str(tmp_path / role)
    options = paper_grid(tmp_path, models)
    one = replace(options, settings=replace(options.settings, batch=1))
    with pytest.raises(InputError) as refused:
        refuse_what_does_not_fit(one.group_plan(), 40 * 2**30)
    assert "batch 1 needs" in str(refused.value) and "--batch" not in str(refused.value)
    assert "lower --n" in str(refused.value)
    with pytest.raises(InputError, match=r"lower --batch \(or --batch auto\) or --n"):
        refuse_what_does_not_fit(options.group_plan(), 40 * 2**30)
