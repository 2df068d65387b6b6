"""Tokenizer calls on the decode path, straight to the Rust tokenizer where the transformers wrapper adds nothing.

`tokenizer.decode(ids)` and `tokenizer.encode(text, add_special_tokens=False)` spend most of their time in the
wrapper (argument handling, type checks of every id) for the short texts of a step, which the Rust tokenizer
decodes several times faster (docs/benchmarks.md). The direct calls are used only where they
give the wrapper's result: a fast tokenizer without space clean-up or split special tokens, checked once on a
probe text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PROBE = "Let x = 12.\n\nThen  x + 3 = 15 <extra_0> é\n<|im_end|> done"


def _backend(tokenizer):
    """The Rust tokenizer when calling it directly is the wrapper's behaviour, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) or \
            getattr(tokenizer, "split_special_tokens", True) or getattr(backend, "encode_special_tokens", False):
        return None
    return backend


def decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """A function equal to `tokenizer.decode` on a list of ids."""
    backend = _backend(tokenizer)
    if backend is not None:
        direct = lambda ids: backend.decode(ids, skip_special_tokens=False)  # noqa: E731
        probe = tokenizer.encode(PROBE, add_special_tokens=False)
        if direct(probe) == tokenizer.decode(probe):
            return direct
    return tokenizer.decode


def encoder(tokenizer) -> Callable[[Sequence[str]], list[list[int]]]:
    """A function equal to `[tokenizer.encode(text, add_special_tokens=False) for text in texts]`: one batched call
    of the Rust tokenizer, without the character offsets nobody reads (`encode_batch_fast`), spread over its threads
    (faster per token than one text at a time: docs/benchmarks.md)."""
    backend = _backend(tokenizer)
    if backend is not None:
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        direct = lambda texts: [e.ids for e in batch(list(texts), add_special_tokens=False)]  # noqa: E731
        if direct([PROBE]) == [tokenizer.encode(PROBE, add_special_tokens=False)]:
            return direct
    return lambda texts: [tokenizer.encode(text, add_special_tokens=False) for text in texts]
