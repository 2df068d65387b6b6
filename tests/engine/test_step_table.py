"""The step-end tables against the text rule (the delimiter in the decoded step), token pair by token pair."""

import random

import pytest

from kvrescue.engine import load_model
from kvrescue.engine.step_table import StepTable, step_table
from kvrescue.prompts import STEP_DELIMITER


def _text_rule_end(tokenizer, tokens: list[int]) -> int | None:
    """Today's rule: the first token after which the decoded step text holds the delimiter."""
    for i in range(len(tokens)):
        if STEP_DELIMITER in tokenizer.decode(tokens[: i + 1]):
            return i
    return None


def _table_rule_end(table: StepTable, tokens: list[int]) -> int | None:
    for i, t in enumerate(tokens):
        if table.contains[t] or (i > 0 and table.ends[tokens[i - 1]] and table.starts[t]):
            return i
    return None


def _check_table(tokenizer) -> None:
    table = step_table(tokenizer)
    assert table.exact
    texts = [tokenizer.decode([t]) for t in range(len(tokenizer))]
    assert all(bool(table.contains[t]) == (STEP_DELIMITER in s) for t, s in enumerate(texts))  # every token
    newline = [t for t, s in enumerate(texts) if "\n" in s]
    plain = [t for t, s in enumerate(texts) if s.strip() and "\n" not in s][:20]
    for a in newline + plain:  # every pair that matters
        for b in newline:
            assert _table_rule_end(table, [a, b]) == _text_rule_end(tokenizer, [a, b]), (texts[a], texts[b])
    rng = random.Random(0)  # and random steps rich in newlines
    for _ in range(300):
        tokens = [rng.choice(newline if rng.random() < 0.3 else plain + newline) for _ in range(12)]
        assert _table_rule_end(table, tokens) == _text_rule_end(tokenizer, tokens)
    for t, s in enumerate(texts):
        assert table.chars[t] >= len(s)


def test_step_table_ends_steps_where_the_text_rule_does(qwen2_dir, llama_dir) -> None:
    _check_table(load_model(qwen2_dir).tokenizer)
    _check_table(load_model(llama_dir).tokenizer)


@pytest.mark.slow
def test_step_table_on_the_smollm2_tokenizer() -> None:
    """SmolLM2's real 49k vocabulary (its GGUF is fetched and converted once, ~100 MB)."""
    from transformers import AutoTokenizer

    from kvrescue.smollm import smollm2_folder
    _check_table(AutoTokenizer.from_pretrained(str(smollm2_folder())))
