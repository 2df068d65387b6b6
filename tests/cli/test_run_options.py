"""`kvrescue run` options end to end (on the tiny random checkpoints, in this process but for Ctrl-C), each driven far enough
that the behaviour it claims happens: contexts several times past B', detector exits of the reason its
threshold forces, evictors, comma lists, sampling options, field options, --overwrite, Ctrl-C, the table."""

import re
import signal
import subprocess
import time
from itertools import combinations
from pathlib import Path

import orjson
import pytest

from kvrescue.cli import num, pct
from kvrescue.report.load import load_run
from tests.helpers import KVRESCUE, kvrescue, kvrescue_run, ok, write_jsonl
from tests.prm_cards import CARDS

MODELS = lambda q, p: ["--base", str(q), "--prm", str(p), "--device", "cpu"]  # noqa: E731
BUDGET = 16
EVICTING = ("rkv", "snapkv", "streaming", "tova", "h2o", "knorm", "keydiff", "random", "pyramidkv", "adakv")
# at B = 16 the default beta leaves PyramidKV uniform (SnapKV): 2 makes its pyramid; Ada-KV over SnapKV's scores
SPECS = {"pyramidkv": "pyramidkv:beta=2", "adakv": "adakv:scores=snapkv"}
B_PRIME = BUDGET + 128
# 10 synthetic steps of 48 tokens: the 57-token prompts (the `problems` fixture's, under the tiny checkpoints' chat
# template) grow to 57 + 480 - 1 = 536 cached tokens, past B' + 3 (B' - B) = 528: at least three compressions
SMALL_RUN = ["--budget", str(BUDGET), "--max-step-tokens", "8", "--max-steps", "2", "--device", "cpu"]
SYNTHETIC = ["--synthetic-steps", "48:10", "--max-step-tokens", "48", "--context-cap", "1024"]


def folders(root: Path) -> dict[str, Path]:
    """Run folders under `root` by name without the hash: `<bench>/<method>-<evictor>-b<B>-n<N>-s<seed>`."""
    return {f"{p.parent.name}/{p.name.rsplit('-', 1)[0]}": p for p in root.glob("*/*") if (p / "config.json").exists()}


def traces(folder: Path) -> list[dict]:
    rows = [orjson.loads(line) for line in (folder / "traces.jsonl").read_bytes().splitlines()]
    return sorted(rows, key=lambda t: t["idx"])


def summary(folder: Path) -> dict:
    return orjson.loads((folder / "summary.json").read_bytes())


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in t.items() if k != "timings"} for t in rows]


# -- eviction -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evictor_runs(tmp_path_factory, problems, qwen2_dir, prm_dir) -> Path:
    """bon with each evictor, and bon --evictor none beside full, on synthetic steps long enough to compress three
    times (`SYNTHETIC`: 10 steps reach 536 cached tokens of the 528 that takes; 12 spent 20 % more decoding)."""
    out = tmp_path_factory.mktemp("evictors")
    common = ["--bench", str(problems), "--n", "2", "--limit", "2", "--budget", str(BUDGET), "--batch", "2",
              "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--out", str(out),
              *MODELS(qwen2_dir, prm_dir), *SYNTHETIC]
    for evictor in EVICTING:
        ok(kvrescue_run(*common, "--method", "bon", "--evictor", SPECS.get(evictor, evictor)))
    ok(kvrescue_run(*common, "--method", "bon,full", "--evictor", "none"))
    tuned = [str(out / "tuned") if a == str(out) else a for a in common]  # beside the others, not among them
    ok(kvrescue_run(*tuned, "--method", "bon", "--evictor", "rkv:lam=0.9,kernel=3"))
    return out


def cached(trace: dict) -> int:
    """Tokens the base cache was fed: the prompt and every committed step but the last token."""
    return trace["tokens"]["base_prefill"] + sum(s["tokens"] for s in trace["steps"]) - 1


def test_every_evicting_row_is_compressed_several_times(evictor_runs):
    found = folders(evictor_runs)
    for evictor in EVICTING:
        folder = found[f"tiny/bon-{evictor}-b{BUDGET}-n2-s0"]
        for t in traces(folder):
            # one token at a time, a row reaches exactly B' and drops to B, so it never held more than B';
            # holding `cached` tokens in at most B' - 1 entries takes (cached - B' + 1) / (B' - B) compressions
            assert t["peak_base_rows"] == B_PRIME and cached(t) >= B_PRIME + 3 * (B_PRIME - BUDGET)
    for method in ("bon-none", "full-none"):  # nothing evicted: the cache holds everything
        for t in traces(found[f"tiny/{method}-b{BUDGET if method == 'bon-none' else 'full'}-n2-s0"]):
            assert t["peak_base_rows"] == cached(t)


def test_evictors_change_the_outputs_and_none_equals_full(evictor_runs):
    found = folders(evictor_runs)
    outputs = {e: [t["output"] for t in traces(found[f"tiny/bon-{e}-b{BUDGET}-n2-s0"])]
               for e in (*EVICTING, "none")}
    for a, b in combinations(outputs, 2):
        assert all(x != y for x, y in zip(outputs[a], outputs[b])), (a, b)
    none, full = found[f"tiny/bon-none-b{BUDGET}-n2-s0"], found["tiny/full-none-bfull-n2-s0"]
    assert untimed(traces(none)) == untimed(traces(full))
    config = orjson.loads((found[f"tiny/bon-snapkv-b{BUDGET}-n2-s0"] / "config.json").read_bytes())["config"]
    assert config["evictor"] == "snapkv" and config["settings"]["synthetic_steps"] == [48, 10]


def test_evictor_parameters_are_set_recorded_and_part_of_the_configuration(evictor_runs):
    name = f"tiny/bon-rkv-b{BUDGET}-n2-s0"
    default, tuned = folders(evictor_runs)[name], folders(evictor_runs / "tuned")[name]
    assert tuned.name != default.name  # another identity, another folder
    settings = [orjson.loads((f / "config.json").read_bytes())["config"]["settings"] for f in (default, tuned)]
    assert "evictor_params" not in settings[0]  # the defaults record nothing: older folders keep their identity
    assert settings[1]["evictor_params"] == {"lam": 0.9, "kernel": 3, "threshold": 0.5}
    allocating = {e: orjson.loads((folders(evictor_runs)[f"tiny/bon-{e}-b{BUDGET}-n2-s0"] / "config.json").read_bytes())
                  ["config"]["settings"]["evictor_params"] for e in SPECS}
    assert allocating == {"pyramidkv": {"kernel": 7, "beta": 2}, "adakv": {"scores": "snapkv", "safeguard": 0.2}}
    assert all(a["output"] != b["output"] for a, b in zip(traces(default), traces(tuned)))
    table = ok(kvrescue("report", str(evictor_runs), "--format", "csv")).stdout.decode()  # the tuned run below too
    assert "bon[rkv, kernel=3, lam=0.9, threshold=0.5]" in table  # its own report row (config.json sorts keys)
    assert "bon[adakv, safeguard=0.2, scores=snapkv]" in table  # a parameter that is a name reads back too


def test_buffer_sets_b_prime_and_is_part_of_the_configuration(evictor_runs, problems, qwen2_dir, prm_dir, tmp_path):
    out, buffer = tmp_path / "runs", 64  # B + W = 80 exceeds the ~57-token prompts
    ok(kvrescue_run("--bench", str(problems), "--n", "2", "--limit", "2", "--budget", str(BUDGET), "--batch", "2",
                    "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--out", str(out), "--method", "bon,full",
                    "--buffer", str(buffer), *MODELS(qwen2_dir, prm_dir), *SYNTHETIC))
    found = folders(out)
    bon, full = found[f"tiny/bon-rkv-b{BUDGET}-n2-s0"], found["tiny/full-none-bfull-n2-s0"]
    for t in traces(bon):  # compressed at B + W instead of B + 128, several times
        assert t["peak_base_rows"] == BUDGET + buffer and cached(t) >= BUDGET + buffer + 3 * buffer
    default = folders(evictor_runs)[f"tiny/bon-rkv-b{BUDGET}-n2-s0"]
    assert bon.name != default.name  # another folder identity
    assert [t["output"] for t in traces(bon)] != [t["output"] for t in traces(default)]
    assert orjson.loads((bon / "config.json").read_bytes())["config"]["settings"]["buffer"] == buffer
    assert orjson.loads((default / "config.json").read_bytes())["config"]["settings"]["buffer"] == 128
    assert orjson.loads((full / "config.json").read_bytes())["config"]["settings"]["buffer"] is None  # no eviction
    assert f"bon[rkv, W={buffer}]" in ok(kvrescue("report", str(out), str(evictor_runs), "--format", "csv")).stdout.decode()


def test_synthetic_steps_end_every_step_after_len_tokens_and_every_problem_after_count(evictor_runs):
    for folder in folders(evictor_runs).values():
        for t in traces(folder):
            assert t["n_steps"] == 10 and t["stop"] == "steps"
            assert all(c["tokens"] == 48 and c["finish"] == "step" for cands in t["candidates"] for c in cands)
        s = summary(folder)
        assert s["accuracy"] is None and s["synthetic"] and s["base_tokens"] == 2 * 10 * 48


# -- the detector -------------------------------------------------------------------------------------
def test_tau_cmp_makes_the_repetition_test_fire(problems, qwen2_dir, llama_dir, prm_dir, tmp_path):
    """Any text compresses under a gzip ratio of 2: every base candidate that reaches 800 characters stops there."""
    ok(kvrescue_run("--bench", str(problems), "--method", "kvrescue", "--n", "2", "--limit", "3", "--batch", "3",
                    "--budget", str(BUDGET), "--helper", str(llama_dir), *MODELS(qwen2_dir, prm_dir),
                    "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--max-step-tokens", "400",
                    "--max-steps", "2", "--tau-cmp", "2.0", "--out", str(tmp_path)))
    (folder,) = folders(tmp_path).values()
    base = [c for t in traces(folder) for cands in t["candidates"] for c in cands if c["source"] == "base"]
    fired = [c for c in base if c["finish"] == "repetition"]
    assert fired  # the rest ended (EOS or a step) before 800 characters
    for c in fired:
        assert c["fired_at"] == c["tokens"] and c["score"] is None and not c["committed"]
        assert c["min_gzip_ratio"] < 2.0 and c["max_mean_entropy"] < 7.0  # the entropy test never fired
    assert all(c["min_gzip_ratio"] is None for c in base if c not in fired)  # ended before 800 characters
    assert summary(folder)["early_exit_rate"] == pytest.approx(len(fired) / len(base))


def test_tau_ent_makes_the_entropy_test_fire(problems, qwen2_dir, llama_dir, prm_dir, tmp_path):
    """This model's mean entropy is about 5.8 nats: a threshold of 5 fires on every base candidate at token 24."""
    ok(kvrescue_run("--bench", str(problems), "--method", "kvrescue", "--n", "2", "--limit", "2", "--batch", "2",
                    "--budget", str(BUDGET), "--helper", str(llama_dir), *MODELS(qwen2_dir, prm_dir),
                    "--max-step-tokens", "40", "--max-steps", "2", "--tau-ent", "5.0", "--out", str(tmp_path)))
    (folder,) = folders(tmp_path).values()
    fired = 0
    for t in traces(folder):
        for step, cands in zip(t["steps"], t["candidates"]):
            base = [c for c in cands if c["source"] == "base"]
            for c in base:
                if c["tokens"] >= 24:
                    assert (c["finish"], c["fired_at"], c["tokens"], c["score"]) == ("entropy", 24, 24, None)
                    assert c["max_mean_entropy"] > 5.0
                else:  # ended before the entropy test applies
                    assert c["finish"] in ("eos", "step") and c["max_mean_entropy"] is None
            fired += sum(c["finish"] == "entropy" for c in base)
            if all(c["finish"] == "entropy" for c in base):
                assert step["source"] == "helper"
    assert fired >= 3


# -- the grid ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grid(tmp_path_factory, problems, qwen2_dir, llama_dir, prm_dir) -> tuple[Path, bytes, Path]:
    """Two benches x bon, full, helper x budgets 16, 24 x N 1, 2 x seeds 0, 1, one problem each."""
    data = tmp_path_factory.mktemp("benches")
    write_jsonl(data / "first.jsonl", [{"question": "What is 1 + 2? Let x be the answer.", "answer": "3"}])
    write_jsonl(data / "second.jsonl", [{"question": "What is 5 + 6? Let x be the answer.", "answer": "11"}])
    out = tmp_path_factory.mktemp("grid")
    done = kvrescue_run("--bench", f"{data / 'first.jsonl'},{data / 'second.jsonl'}",
                        "--method", "bon,full,helper", "--budget", "16,24", "--n", "1,2", "--seed", "0,1",
                        "--helper", str(llama_dir), *MODELS(qwen2_dir, prm_dir), "--max-step-tokens", "8",
                        "--max-steps", "3", "--batch", "2", "--out", str(out), env={"COLUMNS": "250"})
    return out, ok(done).stderr, data


def test_comma_lists_run_every_cell_and_full_and_helper_once_across_budgets(grid):
    out, _, _ = grid
    expected = set()
    for bench in ("first", "second"):
        for n in (1, 2):
            for seed in (0, 1):
                expected |= {f"{bench}/bon-rkv-b{b}-n{n}-s{seed}" for b in (16, 24)}
                expected |= {f"{bench}/{m}-none-bfull-n{n}-s{seed}" for m in ("full", "helper")}
    found = folders(out)
    assert set(found) == expected
    for name, folder in found.items():
        (trace,) = traces(folder)
        assert trace["problem"].startswith("What is 1 + 2" if name.startswith("first") else "What is 5 + 6")
        assert all(len(cands) == int(re.search(r"-n(\d+)-s", name)[1]) for cands in trace["candidates"])
    # seeds are different random streams
    assert traces(found["first/bon-rkv-b16-n2-s0"])[0]["output"] != traces(found["first/bon-rkv-b16-n2-s1"])[0]["output"]


def test_two_problem_files_of_one_name_are_two_sets_of_cells(qwen2_dir, tmp_path):
    for folder, question in (("d1", "What is 1 + 2?"), ("d2", "What is 5 + 6?")):
        (tmp_path / folder).mkdir()
        write_jsonl(tmp_path / folder / "p.jsonl", [{"question": question, "answer": "3"}])
    ok(kvrescue_run("--bench", f"{tmp_path}/d1/p.jsonl,{tmp_path}/d2/p.jsonl", "--method", "bon", "--n", "1",
                    "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--prm", "helper-loglik", *SMALL_RUN,
                    "--out", str(tmp_path / "out")))
    runs = sorted(tmp_path.glob("out/p/*"))
    assert sorted(traces(run)[0]["problem"] for run in runs) == ["What is 1 + 2?", "What is 5 + 6?"]


def test_a_file_named_after_a_benchmark_beside_it_is_refused(qwen2_dir, tmp_path):
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "What is 1 + 2?", "answer": "#### 3"}])
    done = kvrescue_run("--bench", f"gsm8k,{tmp_path}/gsm8k.jsonl", "--method", "bon", "--base", str(qwen2_dir),
                        "--helper", str(qwen2_dir), "--prm", "helper-loglik", *SMALL_RUN, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.decode().strip() == (
        f"error: --bench gsm8k and {tmp_path}/gsm8k.jsonl are different problem sets under one name, 'gsm8k', which "
        "names their run folders: rename one file")
    assert not (tmp_path / "out").exists()


def test_the_final_table_has_one_row_per_cell_with_its_numbers(grid):
    out, stderr, _ = grid
    table = re.split(r"kvrescue run *\n", stderr.decode())[-1]  # after the progress lines, 250 columns wide
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines() if "seed=" in line]
    assert len(rows) == 32
    found = folders(out)
    for cell, acc, steps, base, helper, share, exits, rate in rows:
        bench, method, *named = cell.split()  # a PRM-scored cell's name: bench, method, [B=..] N=.. seed=..
        axes = dict(part.split("=") for part in named)
        evictor, b = ("rkv", axes["B"]) if method == "bon" else ("none", "full")
        s = summary(found[f"{bench}/{method}-{evictor}-b{b}-n{axes['N']}-s{axes['seed']}"])
        assert acc == pct(s["accuracy"]) and rate == num(s["throughput_per_min"])
        assert (steps, base, helper) == tuple(num(s[k]) for k in ("mean_steps", "base_tokens", "helper_tokens"))
        assert (share, exits) == (pct(s["helper_step_share"]), pct(s["early_exit_rate"]))


# -- sampling ------------------------------------------------------------------------------------------
def test_sampling_options_change_the_outputs(grid, qwen2_dir, prm_dir, tmp_path):
    """Greedy, top-k 1 and a top-p under the top token's probability (over 1/512 here) all take the most likely
    token; the defaults (seed 0 in the grid) do not."""
    out, _, data = grid
    common = ["--bench", str(data / "first.jsonl"), "--method", "bon", "--budget", "16",
              "--n", "2", *MODELS(qwen2_dir, prm_dir), "--max-step-tokens", "8", "--max-steps", "3", "--batch", "2"]
    greedy = {}
    for name, option in {"t0": ["--temperature", "0"], "k1": ["--temperature", "1.0", "--top-k", "1"],
                         "p": ["--temperature", "1.0", "--top-k", "0", "--top-p", "0.001"]}.items():
        ok(kvrescue_run(*common, *option, "--out", str(tmp_path / name)))
        (folder,) = folders(tmp_path / name).values()
        (greedy[name],) = traces(folder)
    assert greedy["t0"]["output"] == greedy["k1"]["output"] == greedy["p"]["output"]
    for cands in greedy["t0"]["candidates"]:  # both candidates of a step are the same tokens
        assert cands[0]["score"] == cands[1]["score"] and cands[0]["tokens"] == cands[1]["tokens"]
    (sampled,) = traces(folders(out)["first/bon-rkv-b16-n2-s0"])
    assert sampled["output"] != greedy["t0"]["output"]


# -- fields, --overwrite, Ctrl-C ------------------------------------------------------------------------
def test_problem_and_answer_fields_name_the_columns(qwen2_dir, prm_dir, tmp_path):
    path = write_jsonl(tmp_path / "custom.jsonl", [{"text": "What is 2 + 2?", "question": "decoy", "final": 4},
                                                   {"text": "What is 3 + 3?", "question": "decoy", "final": 6}])
    common = ["--bench", str(path), "--method", "bon", "--budget", "16", "--n", "1", *MODELS(qwen2_dir, prm_dir),
              "--max-step-tokens", "8", "--max-steps", "2", "--out", str(tmp_path / "runs")]
    ok(kvrescue_run(*common, "--problem-field", "text", "--answer-field", "final"))
    (folder,) = folders(tmp_path / "runs").values()
    assert [(t["problem"], t["gt"]) for t in traces(folder)] == [("What is 2 + 2?", "4"), ("What is 3 + 3?", "6")]
    settings = orjson.loads((folder / "config.json").read_bytes())["config"]["settings"]
    assert (settings["problem_field"], settings["answer_field"]) == ("text", "final")
    done = kvrescue_run(*common, "--problem-field", "text", "--answer-field", "solution")
    assert done.returncode == 2 and b"custom.jsonl:1" in done.stderr and b"missing field 'solution'" in done.stderr


def test_overwrite_replaces_a_folder_holding_another_configuration(problems, qwen2_dir, prm_dir, tmp_path):
    args = ["--bench", str(problems), "--method", "bon", "--budget", "16", "--n", "2", "--limit", "2",
            *MODELS(qwen2_dir, prm_dir), "--max-step-tokens", "8", "--max-steps", "3", "--out", str(tmp_path)]
    ok(kvrescue_run(*args))
    (folder,) = folders(tmp_path).values()
    config, before = (folder / "config.json").read_bytes(), traces(folder)
    stored = orjson.loads(config)
    stored["config"]["settings"]["top_k"] = 5
    (folder / "config.json").write_bytes(orjson.dumps(stored))
    (folder / "traces.jsonl").write_bytes(orjson.dumps({**before[0], "idx": 1, "output": "stale"}) + b"\n")
    assert kvrescue_run(*args).returncode == 2  # refused without --overwrite, nothing touched
    assert traces(folder)[0]["output"] == "stale"
    ok(kvrescue_run(*args, "--overwrite"))
    assert orjson.loads((folder / "config.json").read_bytes())["config"] == orjson.loads(config)["config"]
    assert untimed(traces(folder)) == untimed(before) and summary(folder)["complete"]


def test_ctrl_c_writes_what_finished_and_the_same_command_resumes(problems, qwen2_dir, prm_dir, tmp_path):
    args = [KVRESCUE, "run", "--bench", str(problems), "--method", "bon", "--budget", "16", "--n", "2", "--batch", "1",
            *MODELS(qwen2_dir, prm_dir), "--max-step-tokens", "24", "--max-steps", "6", "--out", str(tmp_path)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline, written = time.time() + 300, b""
    while time.time() < deadline and process.poll() is None:
        found = list(tmp_path.glob("tiny/*/traces.jsonl"))
        if found and (written := found[0].read_bytes()).count(b"\n") >= 1:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr.decode()[-2000:]
    assert b"interrupted" in stderr and b"resume" in stderr and b"Traceback" not in stderr
    (folder,) = folders(tmp_path).values()
    kept = traces(folder)
    assert 1 <= len(kept) < 6 and (folder / "traces.jsonl").read_bytes().startswith(written)
    assert summary(folder)["problems"] == len(kept) and not summary(folder)["complete"]
    done = ok(kvrescue(*args[1:]))  # the resume, in this process
    assert b"kvrescue run" in done.stderr
    after = traces(folder)
    assert [t["idx"] for t in after] == list(range(6)) and all(t in after for t in kept)


# -- the PRM's recipe ------------------------------------------------------------------------------------
def test_prm_format_is_part_of_the_configuration_and_changes_the_scores(problems, qwen2_dir, prm_dir, tmp_path):
    common = ["--bench", str(problems), "--method", "bon", "--budget", "16", "--n", "2", "--limit", "1",
              *MODELS(qwen2_dir, prm_dir), "--max-step-tokens", "8", "--max-steps", "3", "--out", str(tmp_path)]
    ok(kvrescue_run(*common))  # the paper's recipe by default
    ok(kvrescue_run(*common, "--prm-format", "model-card"))
    folders_ = sorted(p for p in (tmp_path / "tiny").iterdir())
    assert len(folders_) == 2  # two folder identities
    by_format = {orjson.loads((f / "config.json").read_bytes())["config"]["settings"]["prm_format"]: f for f in folders_}
    assert set(by_format) == {"paper", "model-card"}
    first = [traces(by_format[k])[0]["candidates"][0] for k in ("paper", "model-card")]
    assert [c["tokens"] for c in first[0]] == [c["tokens"] for c in first[1]]  # the same candidates, scored apart
    assert [c["score"] for c in first[0]] != [c["score"] for c in first[1]]
    report = ok(kvrescue("report", str(tmp_path), "--format", "md"))
    assert b"paper recipe" in report.stdout and b"model-card recipe" in report.stdout


@pytest.mark.parametrize("recipe", ["rlhflow", "math-shepherd", "skywork"])
def test_each_prm_recipe_runs_end_to_end_with_its_model_card_s_scores(recipe, problems, qwen2_dir, rlhflow_dir,
                                                                     math_shepherd_dir, skywork_dir, tmp_path):
    """The recipe chosen from the checkpoint (`--prm-recipe auto`), recorded in config.json, and every committed
    step's score (and each first step's other candidate's) the model card's procedure on the trajectory's text."""
    prm = {"rlhflow": rlhflow_dir, "math-shepherd": math_shepherd_dir, "skywork": skywork_dir}[recipe]
    ok(kvrescue_run("--bench", str(problems), "--method", "bon", "--n", "2", "--limit", "1", *MODELS(qwen2_dir, prm),
                    "--dtype", "float32", "--max-step-tokens", "8", "--max-steps", "3", "--out", str(tmp_path)))
    (folder,) = (tmp_path / "tiny").iterdir()
    settings = orjson.loads((folder / "config.json").read_bytes())["config"]["settings"]
    assert settings["prm_recipe"] == recipe and settings["prm_format"] is None
    (trace,) = traces(folder)
    steps = [step["text"].split("<|im_end|>")[0].split("\n\n")[0] for step in trace["steps"]]
    scores = [CARDS[recipe][1](prm, trace["problem"], steps[: k + 1])[-1] for k in range(len(steps))]
    assert [step["score"] for step in trace["steps"]] == pytest.approx(scores, abs=1e-4) and len(steps) == 3
    (other,) = [c for c in trace["candidates"][0] if not c["committed"]]
    first = other["text"].split("<|im_end|>")[0].split("\n\n")[0]
    assert other["score"] == pytest.approx(CARDS[recipe][1](prm, trace["problem"], [first])[0], abs=1e-4)
    run, _ = load_run(folder)
    assert run.setup == ("prm", f"{prm}, {recipe} recipe")  # the report's table titles name it
