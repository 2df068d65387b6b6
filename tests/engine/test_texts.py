"""Direct tokenizer calls (engine/texts.py) against the transformers wrapper they stand in for."""

import random

import pytest

from kvrescue.engine.loader import load_model
from kvrescue.engine.texts import decoder, encoder
from kvrescue_testkit.random_checkpoints import build_tokenizer


def _texts(tokenizer, n: int = 300) -> list[str]:
    rng = random.Random(0)
    pieces = ["Let", " x", " =", " 12", ".", "\n", "\n\n", "  ", " é", "∑", "<extra_0>", "<|im_end|>", "😀", "\t", "ab"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(n)]
    return texts + [tokenizer.decode([t]) for t in range(min(len(tokenizer), 2000))]


def _check(tokenizer) -> None:
    decode, encode = decoder(tokenizer), encoder(tokenizer)
    assert decode != tokenizer.decode  # the direct calls are used for these fast tokenizers
    rng = random.Random(1)
    texts = _texts(tokenizer)
    assert encode(texts) == [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert encode([]) == []
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 40))]
        assert decode(ids) == tokenizer.decode(ids)


def test_direct_calls_equal_the_wrapper(prm_dir) -> None:
    _check(build_tokenizer())
    _check(load_model(prm_dir).tokenizer)


def test_space_clean_up_keeps_the_wrapper() -> None:
    tokenizer = build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    assert decoder(tokenizer) == tokenizer.decode


@pytest.mark.slow
def test_direct_calls_on_the_smollm2_tokenizer() -> None:
    """SmolLM2's real 49k vocabulary (its GGUF is fetched and converted once, ~100 MB)."""
    from transformers import AutoTokenizer

    from kvrescue.smollm import smollm2_folder
    _check(AutoTokenizer.from_pretrained(str(smollm2_folder())))
