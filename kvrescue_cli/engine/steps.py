"""Step generation: many rows (problems x candidates) decoded in one batched loop until each ends a step.

Convention shared with the controller: when a row finishes, its cache holds every token of its step
except the last one, whose logits nobody needs unless the row is committed; `append_tokens` feeds it
(with anything else to append) when the step is committed.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvrescue_cli.engine.caches import KVCache
from kvrescue_cli.engine.loader import LoadedModel
from kvrescue_cli.engine.sampling import SamplingParams, sample

STEP_DELIMITER = "\n\n"
MAX_STEP_TOKENS = 512
MAX_CONTEXT = 4096

TokenCallback = Callable[[int, str, float], str | None]


class StepText:
    """Incremental detokenisation: text pieces whose concatenation is tokenizer.decode(tokens).

    A piece is held back while the decoded tail ends in an incomplete UTF-8 sequence (U+FFFD), and the
    tail is decoded from a few tokens back so that merges across token boundaries come out right.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # tokens[_prefix:_read] decode to the already emitted tail
        self._read = 0

    def push(self, token: int) -> str:
        """Add a token; return the new text it completes (possibly empty)."""
        self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        after = self.tokenizer.decode(self.tokens[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = max(self._read - 4, 0), len(self.tokens)
        self.text += piece
        return piece


@dataclass
class StepResult:
    """One candidate step: its tokens, text (= decode(tokens)), finish reason and per-token entropies."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    entropies: list[float] = field(default_factory=list)


@torch.inference_mode()
def append_tokens(model: LoadedModel, cache: KVCache, rows: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """Append token_lists[i] (non-empty) to rows[i] in one forward; fp32 logits after each row's last token [R, V]."""
    n_new = [len(t) for t in token_lists]
    if min(n_new) < 1:
        raise ValueError("append_tokens: every row needs at least one token")
    batch = torch.zeros(len(rows), max(n_new), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        batch[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
    return model.net.prefill(batch.to(model.device), cache, list(rows), n_new).float()


@torch.inference_mode()
def generate_steps(
    model: LoadedModel,
    cache: KVCache,
    rows: Sequence[int],
    logits: torch.Tensor,
    keys: Sequence[Sequence[int] | int],
    params: SamplingParams = SamplingParams(),
    *,
    callback: TokenCallback | None = None,
    max_step_tokens: int = MAX_STEP_TOKENS,
    max_context: int = MAX_CONTEXT,
    delimiter: str = STEP_DELIMITER,
) -> list[StepResult]:
    """Decode one step for every row at once; rows finish independently and leave the batch.

    logits [R, V]: each row's next-token logits (from `append_tokens`, or the parent's for forks).
    keys[i]: row i's random stream, e.g. (seed, problem idx, step, candidate index).
    A row finishes with `eos`, `step` (the delimiter appeared in its decoded text), the reason the
    callback (row index, token text, entropy) returned, or `length` (max_step_tokens, or its context
    reaching max_context tokens). Each row's cache then holds its step minus the last token.
    """
    results = [StepResult() for _ in rows]
    texts = [StepText(model.tokenizer) for _ in rows]
    start = [cache.length(r) for r in rows]
    eos = set(model.eos_ids)
    live = list(range(len(rows)))
    current = logits
    while live:
        tokens, ents = sample(current, [keys[i] for i in live], [len(results[i].tokens) for i in live], params)
        feed = []
        for i, token, h in zip(live, tokens.tolist(), ents.tolist()):
            res, text = results[i], texts[i]
            tail = text.text[-(len(delimiter) - 1) :] if len(delimiter) > 1 else ""
            piece = text.push(token)
            res.tokens.append(token)
            res.entropies.append(h)
            if token in eos:
                res.finish = "eos"
            elif delimiter in tail + piece:
                res.finish = "step"
            elif callback is not None and (reason := callback(i, piece, h)):
                res.finish = reason
            elif len(res.tokens) >= max_step_tokens or start[i] + len(res.tokens) >= max_context:
                res.finish = "length"
            else:
                feed.append(i)
        if feed:
            fed = torch.tensor([results[i].tokens[-1] for i in feed], device=model.device)
            current = model.net.decode(fed, cache, [rows[i] for i in feed]).float()
        live = feed
    for res in results:
        res.text = model.tokenizer.decode(res.tokens)
    return results
