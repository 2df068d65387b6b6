"""The chat prompt the base and the helper continue (DESIGN sections 2 and 5), in the style each family's authors give.

Styles (`--prompt`):
- `math` (Qwen2.5-Math, the paper's): system = the step-by-step instruction, user = the problem.
- `think` (DeepSeek-R1-Distill, QwQ): no system prompt, the instruction after the problem in the user turn, and
  generation starts inside `<think>` (opened here when the model's template does not open it).
- `qwen3-think`, `qwen3-no-think` (Qwen3): the instruction in the user turn, the template's `enable_thinking`
  switch on or off.
`auto` picks per family: `qwen3-think` for a Qwen3 config, `think` for a model named R1-Distill or QwQ, else `math`.
"""

from __future__ import annotations

from pathlib import Path

from kvrescue.chat_templates import render_chat

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
STEP_DELIMITER = "\n\n"
PROMPT_STYLES = ("auto", "math", "think", "qwen3-think", "qwen3-no-think")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def answer_part(output: str) -> tuple[str, str]:
    """(the text the answer is read from, where): after the last `</think>` when the output has one, as R-KV's and
    Qwen's evaluations of reasoning models read it ("after_think"), else the whole output ("output")."""
    _, close, tail = output.rpartition(THINK_CLOSE)
    return (tail, "after_think") if close else (output, "output")


def chat_messages(problem: str, style: str = "math") -> list[dict[str, str]]:
    """The turns of one problem in `style`: system and user (math), or the user turn alone."""
    if style == "math":
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    return [{"role": "user", "content": f"{problem}\n{SYSTEM_PROMPT}"}]


def chatml(messages: list[dict[str, str]], *, open_assistant: bool) -> str:
    """The ChatML text of `messages` (Qwen's format), optionally opening the assistant turn."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if open_assistant else "")


def generation_prompt(tokenizer, problem: str, style: str = "math") -> str:
    """The prompt text the model continues: its own chat template when it has one, else ChatML."""
    messages = chat_messages(problem, style)
    if getattr(tokenizer, "chat_template", None):
        switch = {"enable_thinking": style == "qwen3-think"} if style.startswith("qwen3") else {}
        text = render_chat(tokenizer, messages, add_generation_prompt=True, **switch)
    else:
        text = chatml(messages, open_assistant=True)
    if style == "think" and not text.rstrip().endswith(THINK_OPEN):
        text += THINK_OPEN + "\n"
    return text


def resolve_style(style: str, model: str, model_type: str | None) -> str:
    """`style`, or for `auto` the style of the model's family (`model`: its id or path; `model_type`: its config's)."""
    if style != "auto":
        return style
    if model_type == "qwen3":
        return "qwen3-think"
    name = Path(model).name.lower()
    return "think" if "r1-distill" in name or "qwq" in name else "math"
