"""Step scorers: the PRM, and a clearly named alternative for setups without PRM weights.

A scorer follows each problem's committed trajectory (`open`, `commit`, `close`) and scores
candidate steps as suffixes of it, many problems per call.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.steps import append_tokens

Request = tuple[int, str, list[int]]  # (problem key, candidate text, candidate tokens in the policy models' tokenizer)


class Scorer(Protocol):
    """What the controller needs from a step scorer."""

    name: str

    def open(self, key: int, problem: str, prompt: list[int]) -> None:
        """Start following a problem (its text, and its prompt tokens in the policy models' tokenizer)."""

    def score(self, requests: list[Request]) -> list[float]:
        """One score per candidate, higher is better."""

    def commit(self, key: int, text: str, tokens: list[int]) -> None:
        """The problem committed this step."""

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens the scorer processed, times its input was truncated)."""


class HelperLoglik:
    """`helper-loglik`: the helper's mean token log-probability of a candidate given the full context.

    Not a process reward model: it is offered where no PRM weights exist (the CPU demo) and is
    labelled as such in every table and summary.
    """

    name = "helper-loglik"

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.rows: dict[int, int] = {}
        self.next_logits: dict[int, torch.Tensor] = {}
        self.processed: dict[int, int] = {}

    def open(self, key: int, problem: str, prompt: list[int]) -> None:
        row = self.runner.cache.create()
        self.rows[key] = row
        self.next_logits[key] = self.runner.append([row], [prompt])[0]
        self.processed[key] = len(prompt)

    @torch.inference_mode()
    def score(self, requests: list[Request]) -> list[float]:
        forks = self.runner.cache.fork_each([self.rows[key] for key, _, _ in requests], 1)
        try:
            logits = append_tokens(self.runner.model, self.runner.cache, forks,
                                   [tokens for _, _, tokens in requests], last_only=False)
        finally:
            self.runner.cache.release(forks)
        scores = []
        for i, (key, _, tokens) in enumerate(requests):
            # The first token is predicted by the committed context, the rest by the candidate's own prefix.
            predicting = torch.cat([self.next_logits[key][None], logits[i, : len(tokens) - 1]])
            logprobs = torch.log_softmax(predicting, dim=-1)
            chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, device=logprobs.device)]
            scores.append(chosen.mean().item())
            self.processed[key] += len(tokens)
        return scores

    def commit(self, key: int, text: str, tokens: list[int]) -> None:
        self.next_logits[key] = self.runner.append([self.rows[key]], [tokens])[0]
        self.processed[key] += len(tokens)

    def close(self, key: int) -> tuple[int, int]:
        self.runner.cache.release([self.rows.pop(key)])
        del self.next_logits[key]
        return self.processed.pop(key), 0
