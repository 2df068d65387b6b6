"""`kvrescue run --help` and the tables at 80 columns (a fixed console width: $COLUMNS): options in panels, every
sampling and step option described, the default models shown, numbers never cut."""

import inspect
import re

from rich.console import Console

from kvrescue import cli
from kvrescue.evictor_catalogue import CATALOGUE
from kvrescue.outputs import RunConfig, Summary
from kvrescue.prm_catalogue import PRM_RECIPES
from tests.helpers import kvrescue, ok

EIGHTY = {"COLUMNS": "80"}


def run_help() -> str:
    return ok(kvrescue("run", "--help", env=EIGHTY, text=True)).stdout


def test_every_run_option_is_in_a_panel_once():
    options = [name for name in inspect.signature(cli.run).parameters if name != "ctx"]
    paneled = [name for names in cli.RUN_PANELS.values() for name in names]
    assert sorted(paneled) == sorted(options)
    text = run_help()
    assert all(f"─ {panel} " in text for panel in cli.RUN_PANELS)


def test_sampling_and_step_options_say_what_they_do_and_what_ends_a_step():
    text = " ".join(run_help().replace("│", " ").split())
    for option in ("--temperature", "--top-p", "--top-k", "--max-steps", "--max-step-tokens", "--context-cap"):
        described = re.search(rf"{option} <[^>]+>(?: range)?(?: \[[^\]]*\])? (\S+)", text)
        assert described and not described[1].startswith("[default"), option
    assert r"A step ends at \n\n (in the decoded text), at EOS or after --max-step-tokens tokens" in text
    assert "[[grid]] tables" in text  # not eaten as rich markup
    for model in cli.DEFAULT_MODELS.values():
        assert f"[default: ({model};" in text



def test_the_evictor_and_prm_recipe_options_name_every_one_of_their_catalogues():
    text = " ".join(run_help().replace("│", " ").split())
    assert f"--evictor <str> {', '.join(CATALOGUE)} or none; NAME:FIELD=VALUE" in text
    assert f"the PRM's recipe: {', '.join(PRM_RECIPES)}, or auto (from" in text


def summary(**numbers) -> Summary:
    fields = {f: None for f in Summary.__dataclass_fields__}
    return Summary(**{**fields, **numbers})


def test_the_closing_table_keeps_every_number_whole_at_80_columns():
    configs = [RunConfig("math500", "kvrescue", 512, 16, "rkv", 3, {}, "prm"),
               RunConfig("/data/a/long/path/of/problems.jsonl", "helper", None, 8, "none", 0, {}, "helper-loglik",
                         synthetic=True)]
    numbers = dict(accuracy=0.505, mean_steps=1023.5, base_tokens=123456.7, helper_tokens=23456.7,
                   helper_step_share=1.0, early_exit_rate=0.125, throughput_per_min=1234.5)
    console = Console(width=80, record=True)
    console.print(cli.summary_table([(config, summary(**numbers)) for config in configs]))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    rows = [line for line in text.splitlines() if "%" in line]
    assert len(rows) == 2
    for row in rows:
        for value in ("50.5%", "1023.5", "123456.7", "23456.7", "100.0%", "12.5%", "1234.5"):
            assert value in row.split()


def test_plan_bench_and_cost_fit_80_columns(qwen2_dir, prm_dir):
    plan = kvrescue("run", "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--prm", str(prm_dir), "--plan",
                    "--device-memory", "80GB", "--devices", "cuda:0,cuda:1", "--tp", "2", env=EIGHTY, text=True)
    bench = ok(kvrescue("bench", env=EIGHTY, text=True))
    cost = ok(kvrescue("cost", "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--prm", str(prm_dir),
                       env=EIGHTY, text=True))
    assert plan.returncode == 0, plan.stderr
    for text in (plan.stderr, bench.stdout, cost.stdout):
        assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    assert re.search(r"^cuda:1 \(0, 1\): \d+\.\d GiB of 70\.8 GiB usable fits$", plan.stderr, re.M)
