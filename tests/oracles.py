"""Reference code the product is checked against, kept in the tests: the degeneration detector's rules (DESIGN
section 4) transcribed token by token (the decode loop's vectorised detector, engine/steps.py, is checked against
it), one step decoded for given rows to the end, PRM scores of whole trajectories from scratch (the cached
scorers, engine/prm.py and vllm_engine/prm.py, are checked against them), and the positions each evictor keeps
from given keys and queries (the bounded cache is checked against them)."""

from __future__ import annotations

from collections import deque
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kvrescue.detect import DetectorConfig, gzip_ratio
from kvrescue.engine.evictors.base import keep_top
from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.snapkv import SnapKV
from kvrescue.engine.evictors.streaming import Streaming
from kvrescue.engine.loader import LoadedModel
from kvrescue.engine.prm import check_prm
from kvrescue.engine.prm_recipes import FORMATS, PRMRecipe, RecipeInputs
from kvrescue.engine.steps import CandidateStep, StepRules
from kvrescue.prompts import SYSTEM_PROMPT
from kvrescue.reasons import ENTROPY, REPETITION
from kvrescue.shapes import OBSERVATION_WINDOW


class Detector:
    """Degeneration state of one candidate.

    ``update`` returns None, or the reason it fired (``"entropy"`` or ``"repetition"``; entropy is
    reported when both hold at the same token). Once fired it stays fired and ignores further tokens.
    """

    def __init__(self, config: DetectorConfig = DetectorConfig()) -> None:
        self.config = config
        self.tokens = 0                           # tokens seen
        self.fired: str | None = None
        self.fired_at: int | None = None          # 1-based index of the token it fired on
        self.max_mean_entropy: float | None = None  # over positions where entropy was checked
        self.min_gzip_ratio: float | None = None    # over positions where the ratio was checked
        self._entropies: deque[float] = deque(maxlen=config.ent_window)
        self._chars = 0
        self._tail = ""
        self._ratio: float | None = None          # ratio of the current tail (reused if unchanged)

    def update(self, text: str, entropy: float) -> str | None:
        """Account for one generated token; return the reason if the candidate degenerated."""
        if self.fired is not None:
            return self.fired
        cfg = self.config
        self.tokens += 1
        self._entropies.append(float(entropy))
        reason = None

        if self.tokens >= cfg.min_tokens:
            mean = sum(self._entropies) / len(self._entropies)
            if self.max_mean_entropy is None or mean > self.max_mean_entropy:
                self.max_mean_entropy = mean
            if mean > cfg.tau_ent:
                reason = ENTROPY

        if text:  # an empty piece leaves the window, and so its ratio, unchanged
            self._chars += len(text)
            self._tail = (self._tail + text)[-cfg.cmp_chars:]
            self._ratio = gzip_ratio(self._tail, cfg.gzip_level) if self._chars >= cfg.cmp_chars else None
        if self._ratio is not None:
            if self.min_gzip_ratio is None or self._ratio < self.min_gzip_ratio:
                self.min_gzip_ratio = self._ratio
            if reason is None and self._ratio < cfg.tau_cmp:
                reason = REPETITION

        if reason is not None:
            self.fired, self.fired_at = reason, self.tokens
        return reason


def generate_steps(runner, rows: Sequence[int], keys: Sequence[Sequence[int] | int], rules: StepRules,
                   screened: Sequence[bool] | None = None) -> list[CandidateStep]:
    """Decode one step for every row (prefilled or forked through `runner`) until each ends; in row order.

    keys[i]: row i's random stream, e.g. (seed, problem idx, step, candidate index). Each row's cache
    then holds its step minus the last token.
    """
    runner.start(rows, keys, [runner.length(r) for r in rows], screened or [False] * len(rows), rules)
    done: dict[int, CandidateStep] = {}
    while runner.busy:
        done.update((step.row, step) for step in runner.advance(wait=True))
    return [done[r] for r in rows]


def trajectory_ids(inputs: RecipeInputs, problem: str, steps: Sequence[str],
                   system: str = SYSTEM_PROMPT) -> tuple[list[int], list[int]]:
    """A whole trajectory's input ids as the recipe builds them (the prompt and each step's committed piece, as
    `PRMInputs` builds them), and the position of each step's score: the last token of its candidate piece."""
    ids, ends = inputs.prompt(problem, system), []
    for i, step in enumerate(steps):
        ends.append(len(ids) + len(inputs.candidates([step], [i])[0]) - 1)
        ids = ids + inputs.committed(step, i)
    return ids, ends


@torch.inference_mode()
def prm_scores(prm: LoadedModel, problem: str, steps: Sequence[str], system: str = SYSTEM_PROMPT,
               recipe: PRMRecipe = FORMATS["paper"]) -> list[float]:
    """From-scratch reference: score of every step of a whole trajectory in one plain forward."""
    inputs = check_prm(prm, recipe)
    ids, ends = trajectory_ids(inputs, problem, steps, system)
    return inputs.read(prm.logits(torch.tensor([ids]))[0][ends]).tolist()


@torch.inference_mode()
def prm_last_scores(prm: LoadedModel, problem: str, trajectories: Sequence[Sequence[str]],
                    system: str = SYSTEM_PROMPT, recipe: PRMRecipe = FORMATS["paper"]) -> list[float]:
    """From scratch, batched: the last step's score of each trajectory, all in one right-padded forward
    (attention is causal, so no real token sees the padding after it). No prefix is shared or cached."""
    inputs = check_prm(prm, recipe)
    rows = [trajectory_ids(inputs, problem, steps, system) for steps in trajectories]
    width = max(len(row) for row, _ in rows)
    ids = torch.tensor([row + [0] * (width - len(row)) for row, _ in rows])
    head = prm.logits(ids)
    return inputs.read(torch.stack([head[i, ends[-1]] for i, (_, ends) in enumerate(rows)])).tolist()


def rkv_keep(keys: Tensor, queries: Tensor, budget: int, **params) -> Tensor:
    """Positions R-KV keeps per KV head, [..., H_kv, budget], ascending (`params`: RKV's fields)."""
    return keep_top(RKV(**params).score(keys, queries), budget)


def snapkv_keep(keys: Tensor, queries: Tensor, budget: int, **params) -> Tensor:
    """Positions SnapKV keeps per KV head, [..., H_kv, budget], ascending."""
    return keep_top(SnapKV(**params).score(keys, queries), budget)


def streaming_scores(length: int, **params) -> Tensor:
    """StreamingLLM's scores of the past positions of a row of `length` entries, [length - OBSERVATION_WINDOW]."""
    return Streaming(**params).score(torch.zeros(length, 1), torch.zeros(0))


def streaming_keep(length: int, budget: int, **params) -> Tensor:
    """Positions StreamingLLM keeps: the first `sinks` and the last ``budget - sinks``, [budget]."""
    sinks = Streaming(**params).sinks
    if not sinks + OBSERVATION_WINDOW <= budget < length:
        raise ValueError(f"need {sinks + OBSERVATION_WINDOW} <= budget {budget} < length {length}")
    return keep_top(streaming_scores(length, **params), budget)


def adakv_keep_past(scores: list[list[float]], budget: int, most: int, safeguard: float) -> list[list[int]]:
    """kvpress's `AdaKVPress.compress` on one layer's past scores per KV head (-inf: no entry), line by line on lists:
    each head's top int(n_kept * alpha_safeguard) raised to the largest score, then the H x n_kept best of all heads
    kept (here n_kept = budget - W past entries, ties to the lower head and the earlier position), no head more than
    most - W. The kept past positions per head, ascending."""
    n_kept = budget - 8
    n_safe = int(n_kept * safeguard)
    boosted = []
    for head in scores:
        ranked = sorted(range(len(head)), key=lambda j: (-head[j], j))
        rank = {j: r for r, j in enumerate(ranked)}
        boosted.append([math.inf if rank[j] < n_safe else -math.inf if rank[j] >= most - 8 else head[j]
                        for j in range(len(head))])
    flat = sorted(((h, j) for h in range(len(scores)) for j in range(len(scores[h]))),
                  key=lambda hj: (-boosted[hj[0]][hj[1]], hj[0], hj[1]))[: len(scores) * n_kept]
    return [sorted(j for h2, j in flat if h2 == h) for h in range(len(scores))]
