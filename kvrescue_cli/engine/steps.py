"""Step generation: many rows (problems x candidates) decoded in one batched loop until each ends a step.

Convention shared with the controller: when a row finishes, its cache holds every token of its step
except the last one, whose logits nobody needs unless the row is committed; `append_tokens` feeds it
(with anything else to append) when the step is committed.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvrescue_cli.engine.caches import KVCache
from kvrescue_cli.engine.loader import LoadedModel
from kvrescue_cli.engine.sampling import SamplingParams, sample
from kvrescue_cli.prompts import STEP_DELIMITER

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


@dataclass(frozen=True)
class StepLimits:
    """When a step ends, besides the callback: EOS, the delimiter, the per-step cap and the context cap.

    `fixed_length` (synthetic throughput runs) ends every step after that many tokens and ignores EOS
    and the delimiter.
    """

    eos: frozenset[int]
    max_step_tokens: int = MAX_STEP_TOKENS
    max_context: int = MAX_CONTEXT
    delimiter: str = STEP_DELIMITER
    fixed_length: int | None = None


class CandidateStep:
    """One row's step as it is decoded: tokens, text (= decode(tokens) once finished), entropies, finish reason.

    `callback(token_text, entropy)` may end the step early by returning a reason (the detector does).
    """

    def __init__(self, tokenizer, context: int, limits: StepLimits,
                 callback: Callable[[str, float], str | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.context = context  # tokens before the step: prompt + committed steps
        self.limits = limits
        self.callback = callback
        self.detok = StepText(tokenizer)
        self.entropies: list[float] = []
        self.text = ""
        self.finish: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.detok.tokens

    def push(self, token: int, entropy: float) -> str | None:
        """Add a sampled token; return the finish reason if the step ends with it."""
        limits = self.limits
        tail = self.detok.text[1 - len(limits.delimiter):] if len(limits.delimiter) > 1 else ""
        piece = self.detok.push(token)
        self.entropies.append(entropy)
        n = len(self.tokens)
        if limits.fixed_length is not None:
            self.finish = "step" if n >= limits.fixed_length else None
        elif token in limits.eos:
            self.finish = "eos"
        elif limits.delimiter in tail + piece:
            self.finish = "step"
        if self.finish is None and self.callback is not None:
            self.finish = self.callback(piece, entropy)
        if self.finish is None and (n >= limits.max_step_tokens or self.context + n >= limits.max_context):
            self.finish = "length"
        if self.finish is not None:
            self.text = self.tokenizer.decode(self.tokens)
        return self.finish


@torch.inference_mode()
def append_tokens(model: LoadedModel, cache: KVCache, rows: Sequence[int], token_lists: Sequence[Sequence[int]],
                  last_only: bool = True) -> torch.Tensor:
    """Append token_lists[i] (non-empty) to rows[i] in one forward (right padded).

    Returns fp32 head outputs after each row's last token [R, V], or at every position [R, T, V].
    """
    n_new = [len(t) for t in token_lists]
    if min(n_new) < 1:
        raise ValueError("append_tokens: every row needs at least one token")
    batch = torch.zeros(len(rows), max(n_new), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        batch[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
    return model.net.prefill(batch.to(model.device), cache, list(rows), n_new, last_only).float()


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
) -> list[CandidateStep]:
    """Decode one step for every row at once; rows finish independently and leave the batch.

    logits [R, V]: each row's next-token logits (from `append_tokens`, or the parent's for forks).
    keys[i]: row i's random stream, e.g. (seed, problem idx, step, candidate index).
    A row finishes with `eos`, `step` (the delimiter appeared in its decoded text), the reason the
    callback (row index, token text, entropy) returned, or `length` (max_step_tokens, or its context
    reaching max_context tokens). Each row's cache then holds its step minus the last token.
    """
    limits = StepLimits(frozenset(model.eos_ids), max_step_tokens, max_context, delimiter)
    steps = [
        CandidateStep(model.tokenizer, cache.length(r), limits, partial(callback, i) if callback else None)
        for i, r in enumerate(rows)
    ]
    live = list(range(len(rows)))
    current = logits
    while live:
        tokens, ents = sample(current, [keys[i] for i in live], [len(steps[i].tokens) for i in live], params)
        live = [i for i, token, h in zip(live, tokens.tolist(), ents.tolist()) if steps[i].push(token, h) is None]
        if live:
            fed = torch.tensor([steps[i].tokens[-1] for i in live], device=model.device)
            current = model.net.decode(fed, cache, [rows[i] for i in live]).float()
    return steps
