"""Step scorers: the PRM, and a clearly named alternative for setups without PRM weights.

A scorer follows each problem's committed trajectory (`open`, `commit`, `close`) and scores
candidate steps as suffixes of it, many problems per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kvrescue.engine.runner import Runner
from kvrescue.engine.steps import padded_tokens
from kvrescue.engine.streams import ModelStream, on_stream
from kvrescue.engine.transfer import Download, upload_all
from kvrescue.scorers import HELPER_LOGLIK
from kvrescue.shapes import LOGITS_BYTES

Request = tuple[int, str, list[int]]  # (problem key, candidate text, candidate tokens in the policy models' tokenizer)
UNSEEN_SCORE = 0.0  # a step the PRM sees no token of: the lowest score a PRM gives (each recipe's is a probability)


class Scorer(Protocol):
    """What the controller needs from a step scorer."""

    name: str

    def open(self, key: int, problem: str, prompt: list[int]) -> None:
        """Start following a problem (its text, and its prompt tokens in the policy models' tokenizer)."""

    def score(self, requests: list[Request]) -> list[float | None]:
        """One score per candidate, higher is better; None for one the scorer sees no token of (the controller
        gives it UNSEEN_SCORE and counts it). A scorer that computes on a device may also have
        `launch(requests) -> PendingScores`: the same scores, read later (the controller decodes meanwhile)."""

    def commit(self, key: int, text: str, tokens: list[int]) -> None:
        """The problem committed this step."""

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens the scorer processed, times its input was truncated)."""


class PendingScores:
    """One call's scores on their way from the device to the host (`transfer.Download`): `wait` reads them, None
    for the candidates the scorer saw no token of (those not in `seen`)."""

    def __init__(self, count: int, seen: list[int], values: torch.Tensor | None) -> None:
        """values [len(seen)]: the scores of candidates `seen` (indices into the call's `count` requests)."""
        self.count, self.seen = count, seen
        self.download = None if values is None else Download(values)

    def wait(self) -> list[float | None]:
        scores: list[float | None] = [None] * self.count
        if self.download is not None:
            for i, value in zip(self.seen, self.download.wait().tolist()):
                scores[i] = value
        return scores


def chosen_logprobs(logits: Callable[[int, int], torch.Tensor], targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """log_softmax(logits)[target] at each of len(targets) positions, logits(a, b) [b - a, vocab] giving those of
    positions a..b-1: as many positions at a time as fit LOGITS_BYTES in fp32."""
    n, step = len(targets), max(1, LOGITS_BYTES // (4 * vocab))
    parts = [torch.log_softmax(logits(a, min(a + step, n)).float(), dim=-1).gather(1, targets[a : a + step, None])
             for a in range(0, n, step)]
    return torch.cat(parts)[:, 0] if parts else torch.zeros(0, device=targets.device)


class HelperLoglik:
    """`helper-loglik`: the helper's mean token log-probability of a candidate given the full context.

    Not a process reward model: it is offered where no PRM weights exist (the CPU demo) and is
    labelled as such in every table and summary.
    """

    name = HELPER_LOGLIK

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.rows: dict[int, int] = {}
        self.next_logits: dict[int, torch.Tensor] = {}
        self.processed: dict[int, int] = {}

    @property
    def stream(self) -> ModelStream:
        """Its runner's: it reads and writes that runner's cache."""
        return self.runner.stream

    @on_stream
    def open(self, key: int, problem: str, prompt: list[int]) -> None:
        row = self.runner.cache.create()
        self.rows[key] = row
        self.next_logits[key] = self.runner.append([row], [prompt])[0]
        self.processed[key] = len(prompt)

    def score(self, requests: list[Request]) -> list[float]:
        """Each candidate's mean token log-probability (`launch`, waited for)."""
        return self.launch(requests).wait()

    @on_stream
    @torch.inference_mode()
    def launch(self, requests: list[Request]) -> PendingScores:
        """Each candidate's mean token log-probability, all candidates in one forward, read later; the fp32 logits
        exist a chunk of positions at a time (`chosen_logprobs`), never for all at once."""
        if not requests:
            return PendingScores(0, [], None)
        runner, token_lists = self.runner, [tokens for _, _, tokens in requests]
        forks = runner.cache.fork_each([self.rows[key] for key, _, _ in requests], 1)
        try:
            batch, n_new = padded_tokens(token_lists, runner.device)
            hidden = runner.model.net.append_hidden(batch, runner.cache, forks, n_new)  # [R, T, dim]
        finally:
            runner.cache.release(forks)
        # Token 0 of a candidate is predicted by the committed context (its kept logits), token j > 0 by the hidden
        # state of token j - 1: where each later token lies ([R, T] places) and which state predicts it.
        owner = np.repeat(np.arange(len(requests)), np.asarray(n_new) - 1)
        at = np.concatenate([np.arange(1, n) for n in n_new])
        dev = upload_all({"first": [t[0] for t in token_lists], "later": np.concatenate([t[1:] for t in token_lists]),
                          "owner": owner, "at": at, "state": owner * batch.shape[1] + at - 1, "n": n_new},
                         runner.device)
        kept = [self.next_logits[key] for key, _, _ in requests]
        vocab = kept[0].shape[-1]
        chosen = torch.zeros(batch.shape, dtype=torch.float32, device=runner.device)  # each token's log-probability
        chosen[:, 0] = chosen_logprobs(lambda a, b: torch.stack(kept[a:b]), dev["first"], vocab)
        states, head = hidden.flatten(0, 1).index_select(0, dev["state"]), runner.model.net.head
        chosen[dev["owner"], dev["at"]] = chosen_logprobs(lambda a, b: head(states[a:b]), dev["later"], vocab)
        for key, _, tokens in requests:
            self.processed[key] += len(tokens)
        return PendingScores(len(requests), list(range(len(requests))), chosen.sum(1) / dev["n"])

    @on_stream
    def commit(self, key: int, text: str, tokens: list[int]) -> None:
        self.next_logits[key] = self.runner.append([self.rows[key]], [tokens])[0]
        self.processed[key] += len(tokens)

    @on_stream
    def close(self, key: int) -> tuple[int, int]:
        self.runner.cache.release([self.rows.pop(key)])
        del self.next_logits[key]
        return self.processed.pop(key), 0
