"""The Qwen2.5-Math chat prompt shared by the base, the helper and the PRM (DESIGN sections 2 and 5)."""

from __future__ import annotations

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
STEP_DELIMITER = "\n\n"


def chat_messages(problem: str) -> list[dict[str, str]]:
    """System and user turns for one problem."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]


def chatml(messages: list[dict[str, str]], *, open_assistant: bool) -> str:
    """The ChatML text of `messages` (Qwen's format), optionally opening the assistant turn."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if open_assistant else "")


def generation_prompt(tokenizer, problem: str) -> str:
    """The prompt text the model continues: its own chat template when it has one, else ChatML."""
    messages = chat_messages(problem)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return chatml(messages, open_assistant=True)
