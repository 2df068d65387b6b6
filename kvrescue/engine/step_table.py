"""Per-vocabulary step-end tables: which token ids end a step (the delimiter `\\n\\n` in a token's text, or across
two tokens), read by the decode loop (`steps.StepDecoder`) on the device instead of decoded text."""

from __future__ import annotations

import warnings

import torch

from kvrescue.prompts import STEP_DELIMITER


class StepTable:
    """Per-vocabulary facts that decide step ends from token ids, computed once per tokenizer.

    With `texts[t]` = decode([t]): the delimiter ends a step at token b after token a when texts[b]
    contains `\\n\\n`, or texts[a] ends with `\\n` and texts[b] starts with `\\n`. That is exact when
    decoding concatenates around newlines, which `exact` records after checking every token holding a
    newline in context and every (ends with `\\n`, starts with `\\n`) pair. `chars[t]` bounds the
    characters a token adds to a decoded text, so the gzip test decodes only rows that may have enough.
    """

    def __init__(self, tokenizer) -> None:
        n = len(tokenizer)
        texts = _decode_all(tokenizer, [[t] for t in range(n)])
        newline = [t for t, s in enumerate(texts) if "\n" in s]
        ends = [t for t in newline if texts[t].endswith("\n")]
        starts = [t for t in newline if texts[t].startswith("\n")]
        self.exact = self._concatenates(tokenizer, texts, newline, ends, starts)
        self.contains = torch.tensor([STEP_DELIMITER in s for s in texts])
        self.ends = torch.zeros(n, dtype=torch.bool)
        self.ends[ends] = True
        self.starts = torch.zeros(n, dtype=torch.bool)
        self.starts[starts] = True
        self.newline = torch.zeros(n, dtype=torch.bool)
        self.newline[newline + [t for t, s in enumerate(texts) if "\ufffd" in s]] = True
        self.chars = torch.tensor([len(s) + (0 if self.exact else 1) for s in texts])

    @staticmethod
    def _concatenates(tokenizer, texts: list[str], newline: list[int], ends: list[int], starts: list[int]) -> bool:
        """Whether decoding keeps every newline where the single-token texts put it."""
        plain = next((t for t, s in enumerate(texts) if s.isalpha()), None)
        if plain is None or any("\ufffd" in texts[t] for t in newline):
            return False
        strip = lambda s: s.replace(" ", "")  # noqa: E731  (some decoders drop a leading space)
        in_context = _decode_all(tokenizer, [[plain, t, plain] for t in newline])
        if any(strip(s) != strip(texts[plain] + texts[t] + texts[plain]) for s, t in zip(in_context, newline)):
            return False
        return all(STEP_DELIMITER in s for s in _decode_all(tokenizer, [[a, b] for a in ends for b in starts]))

    def to(self, device: torch.device) -> "StepTable":
        """The same table with its tensors on `device`."""
        moved = object.__new__(StepTable)
        moved.exact = self.exact
        for name in ("contains", "ends", "starts", "newline", "chars"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved


def _decode_all(tokenizer, id_lists: list[list[int]]) -> list[str]:
    """tokenizer.decode of every list, in one batched call of the Rust tokenizer when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.batch_decode(id_lists)
    return backend.decode_batch(id_lists, skip_special_tokens=False)


_TABLES: dict[int, tuple[object, StepTable]] = {}


def step_table(tokenizer) -> StepTable:
    """The tokenizer's table, built on first use and kept (seconds for a large vocabulary: docs/benchmarks.md)."""
    entry = _TABLES.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _TABLES[id(tokenizer)] = (tokenizer, StepTable(tokenizer))
        if not entry[1].exact:
            warnings.warn(f"{type(tokenizer).__name__}: step ends can't be read from token ids exactly; rows whose "
                          "token holds a newline are checked on decoded text instead", stacklevel=2)
    return entry[1]
