"""Chat templates render in a confined worker: the text transformers gives, and a hostile template (endless loops,
memory bombs, sandbox breaches, syntax errors, recursion) is a one-line ChatTemplateError naming the model."""

from __future__ import annotations

import pytest

from kvrescue import chat_templates
from kvrescue.chat_templates import ChatTemplateError, render_chat, render_chats
from kvrescue.engine.loader import load_tokenizer
from kvrescue_testkit.random_checkpoints import build_tokenizer
from kvrescue_testkit.random_tokenizers import LLAMA31_CHAT_TEMPLATE
from kvrescue.prompts import chat_messages

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {
    "repeat": ("{{ 'x' * 20000000000 }}", "MemoryError"),
    "center": ("{{ 'x' | center(2000000000) }}", ""),
    "sandbox": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    "syntax": ("{% for %}", "TemplateSyntaxError"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "raise": ("{{ raise_exception('no system turns') }}", "TemplateError: no system turns"),
}


@pytest.mark.parametrize("template", [None, LLAMA31_CHAT_TEMPLATE])
def test_the_text_is_what_apply_chat_template_gives(qwen2_dir, template) -> None:
    tokenizer = load_tokenizer(qwen2_dir)[0] if template is None else build_tokenizer(chat_template=template)
    conversations = [chat_messages("What is 1+1?"), chat_messages("And 2+2?", "think")]
    for options in ({}, {"add_generation_prompt": True}):
        expected = [tokenizer.apply_chat_template(c, tokenize=False, **options) for c in conversations]
        assert render_chats(tokenizer, conversations, **options) == expected


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_template_is_one_line_naming_the_model(case: str, monkeypatch) -> None:
    monkeypatch.setattr(chat_templates, "RENDER_TIMEOUT_S", 3.0)
    template, reason = HOSTILE[case]
    tokenizer = build_tokenizer(chat_template=template)
    tokenizer.name_or_path = "models/hostile"
    with pytest.raises(ChatTemplateError) as caught:
        render_chat(tokenizer, chat_messages("1+1?"))
    message = str(caught.value)
    assert message.startswith("models/hostile: its chat template ") and reason in message and "\n" not in message


def test_a_template_that_never_ends_is_stopped_at_the_time_limit(monkeypatch) -> None:
    monkeypatch.setattr(chat_templates, "RENDER_TIMEOUT_S", 2.0)
    tokenizer = build_tokenizer(chat_template=NESTED_LOOPS)
    with pytest.raises(ChatTemplateError, match=r"ran past its bounds \(2 s"):
        render_chat(tokenizer, chat_messages("1+1?"))
    assert render_chat(build_tokenizer(), chat_messages("1+1?")).startswith("<|im_start|>system")  # a fresh worker
