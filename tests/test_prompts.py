"""Prompt styles per model family (`--prompt`), and answers read after `</think>` in grading."""

import json

import orjson
import pytest
from transformers import AutoTokenizer

from kvrescue.prompts import SYSTEM_PROMPT, answer_part, generation_prompt, resolve_style
from kvrescue_testkit.random_checkpoints import QWEN3_CHAT_TEMPLATE, build_tokenizer, write_random_checkpoint
from tests.conftest import TINY
from tests.helpers import kvrescue, kvrescue_run, read_folder
from tests.cli.test_run import SMALL

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


# DeepSeek-R1-Distill's chat template, transcribed to what a problem's prompt uses: the BOS, a system prompt's
# text with no markers, `<｜User｜>` turns, and `<｜Assistant｜>` opening generation (the template's later revision
# also opens the thought: `<｜Assistant｜><think>\n`).
R1_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
R1_TEMPLATE = (
    "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = m['content'] %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.system }}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>OPEN' }}{% endif %}"
)


def r1_tokenizer(opens_thought: bool):
    tok = build_tokenizer(chat_template=R1_TEMPLATE.replace("OPEN", "<think>\\n" if opens_thought else ""))
    tok.add_special_tokens({"bos_token": R1_TOKENS[0], "eos_token": R1_TOKENS[1],
                            "additional_special_tokens": R1_TOKENS[2:]})
    return tok


@pytest.mark.parametrize("opens_thought", [True, False])
def test_r1_distill_prompt_follows_deepseeks_conventions(opens_thought):
    """No system prompt, the instruction in the user turn, generation starting inside `<think>` (DeepSeek-R1's
    usage recommendations), whichever revision of the template the checkpoint carries."""
    assert generation_prompt(r1_tokenizer(opens_thought), QUESTION, "think") == (
        f"<｜begin▁of▁sentence｜><｜User｜>{QUESTION}\n{SYSTEM_PROMPT}<｜Assistant｜><think>\n")


def write_r1_distill(folder, arch: str, seed: int):
    """A random checkpoint shaped as DeepSeek-R1-Distill-`arch`: its name, R1's tokens and template, its EOS."""
    write_random_checkpoint(folder, arch, vocab_size=520, seed=seed, **TINY)
    tok = r1_tokenizer(opens_thought=True)
    tok.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)  # as the engine reads it
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg.update(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
        (folder / name).write_text(json.dumps(cfg))
    return folder, tok


def test_r1_distill_shaped_models_run_end_to_end(problems, prm_dir, tmp_path):
    """An R1-Distill-Qwen base on the evicting cache and an R1-Distill-Llama helper, `--prompt auto`: the
    `think` style from the models' names, each problem's prompt as DeepSeek's conventions build it."""
    base, tok = write_r1_distill(tmp_path / "DeepSeek-R1-Distill-Qwen-tiny", "qwen2", seed=11)
    helper, _ = write_r1_distill(tmp_path / "DeepSeek-R1-Distill-Llama-tiny", "llama", seed=12)
    out = tmp_path / "runs"
    done = kvrescue_run("--bench", str(problems), "--method", "kvrescue", "--n", "2", "--limit", "2",
                        "--base", str(base), "--helper", str(helper), "--prm", str(prm_dir), "--out", str(out),
                        *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    config, traces, _ = read_folder(out, "kvrescue")
    assert config["config"]["settings"]["prompt"] == "think"
    questions = [orjson.loads(line)["question"] for line in problems.read_bytes().splitlines()[:2]]
    for trace, question in zip(traces, questions):
        prompt = f"<｜begin▁of▁sentence｜><｜User｜>{question}\n{SYSTEM_PROMPT}<｜Assistant｜><think>\n"
        assert trace["stop"] != "skipped" and trace["n_steps"] >= 1
        assert trace["answer_from"] in ("output", "after_think")
        # The base prefilled its prompt and each helper step committed before the last (the problem stops there).
        helper_steps = sum(s["tokens"] for s in trace["steps"][:-1] if s["source"] == "helper")
        assert trace["tokens"]["base_prefill"] - helper_steps == len(tok.encode(prompt, add_special_tokens=False))
