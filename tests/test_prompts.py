"""Prompt styles per model family (`--prompt`), and answers read after `</think>` in grading."""

import json

import orjson
import pytest

from kvrescue_cli.grading import answer_part
from kvrescue_cli.prompts import SYSTEM_PROMPT, generation_prompt, resolve_style
from kvrescue_cli.random_checkpoints import QWEN3_CHAT_TEMPLATE, build_tokenizer
from tests.helpers import kvrescue, kvrescue_run, read_folder
from tests.test_run import SMALL

QUESTION = "What is 1 + 1?"
USER_TURN = f"<|im_start|>user\n{QUESTION}\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def chatml():
    return build_tokenizer()


def test_math_is_the_papers_system_and_user_turns(chatml):
    assert generation_prompt(chatml, QUESTION, "math") == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_think_puts_the_instruction_in_the_user_turn_and_opens_the_thought_once(chatml):
    assert generation_prompt(chatml, QUESTION, "think") == USER_TURN + "<think>\n"
    r1_like = build_tokenizer(chat_template=chatml.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"))  # a template that opens it itself
    assert generation_prompt(r1_like, QUESTION, "think") == USER_TURN + "<think>\n"


def test_qwen3_styles_flip_the_templates_thinking_switch():
    qwen3 = build_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)
    assert generation_prompt(qwen3, QUESTION, "qwen3-think") == USER_TURN
    assert generation_prompt(qwen3, QUESTION, "qwen3-no-think") == USER_TURN + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("model, model_type, style", [
    ("Qwen/Qwen2.5-Math-7B-Instruct", "qwen2", "math"),
    ("Qwen/Qwen3-8B", "qwen3", "qwen3-think"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "qwen2", "think"),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "llama", "think"),
    ("/models/QwQ-32B", "qwen2", "think"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", None, "math"),
])
def test_auto_picks_each_familys_style(model, model_type, style):
    assert resolve_style("auto", model, model_type) == style
    assert resolve_style("math", model, model_type) == "math"  # a named style is kept


def test_the_answer_is_read_after_the_last_think_close():
    assert answer_part("<think>\\boxed{3}</think>So \\boxed{4}") == ("So \\boxed{4}", "after_think")
    assert answer_part("a</think>b</think>\\boxed{5}") == ("\\boxed{5}", "after_think")
    assert answer_part("no thought: \\boxed{6}") == ("no thought: \\boxed{6}", "output")


def test_grade_reads_answers_after_the_thought(tmp_path):
    rows = [{"output": "<think>maybe \\boxed{3}</think>\n\nThe answer is \\boxed{4}.", "gt": "4"},
            {"output": "<think>it is \\boxed{4}</think>\n\nI am not sure.", "gt": "4"},  # boxed only in the thought
            {"output": "The answer is \\boxed{4}.", "gt": "4"}]
    source = tmp_path / "outputs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = kvrescue("grade", str(source), "--bench", "gsm8k")
    assert done.returncode == 0, done.stderr.decode()
    graded = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert [(g["correct"], g["answer_from"]) for g in graded] == [(True, "after_think"), (False, "after_think"),
                                                                  (True, "output")]


def test_a_run_records_its_prompt_style(problems, qwen2_dir, prm_dir, tmp_path):
    runs = {}
    for style in ("think", "auto"):
        out = tmp_path / style
        done = kvrescue_run("--bench", str(problems), "--method", "bon", "--n", "1", "--limit", "1", "--base",
                            str(qwen2_dir), "--prm", str(prm_dir), "--out", str(out), "--prompt", style, *SMALL)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        runs[style] = read_folder(out, "bon")
    config, traces, _ = runs["think"]
    assert config["config"]["settings"]["prompt"] == "think" and traces[0]["answer_from"] in ("output", "after_think")
    assert "prompt" not in runs["auto"][0]["config"]["settings"]  # a Qwen2 model: the paper's prompt, as before
    assert runs["auto"][0]["hash"] != config["hash"]
