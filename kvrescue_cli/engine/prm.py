"""Process reward scoring (Qwen2.5-Math-PRM recipe, DESIGN section 5) with a cached committed prefix.

Input text: the chat template with the system prompt, user = problem, assistant =
"<extra_0>".join(steps) + "<extra_0>"; a step's score is softmax(head)[1] at its <extra_0>. Each
problem's committed prefix lives in one FullCache row; a candidate is scored as a suffix (fork, append
its tokens + <extra_0>, read the head, release), all candidates of all problems in one forward.
Special tokens split the text before BPE, so scoring by suffix equals scoring the whole text (the first
step's boundary after "assistant\\n" too, unless the step itself begins with a newline).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrescue_cli.engine.caches import TORCH_BLOCK, FullCache, block_size_for
from kvrescue_cli.engine.loader import LoadedModel
from kvrescue_cli.engine.scoring import Request
from kvrescue_cli.engine.steps import append_tokens
from kvrescue_cli.engine.texts import encoder
from kvrescue_cli.prompts import STEP_DELIMITER, SYSTEM_PROMPT, chatml
from kvrescue_cli.shapes import PRM_WINDOW

STEP_TAG = "<extra_0>"
END_MARKERS = ("<|im_end|>", "<|endoftext|>")
WINDOW = PRM_WINDOW  # tokens of a problem's committed prefix the PRM sees (older steps are dropped)


def prm_step_text(text: str) -> str:
    """A generated step as the PRM sees it: cut at an end-of-text marker, without the `\\n\\n` delimiter."""
    for marker in END_MARKERS:
        text = text.split(marker)[0]
    return text.split(STEP_DELIMITER)[0]


def _prompt_text(tokenizer, problem: str, system: str) -> str:
    """The chat text up to where the assistant's content starts."""
    hole = "\x00kvrescue-assistant\x00"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": problem},
                {"role": "assistant", "content": hole}]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        rendered = chatml(messages, open_assistant=False)
    return rendered[: rendered.index(hole)]


def step_tag_id(tokenizer, name: str) -> int:
    """The id of `<extra_0>`, where the PRM reads each step's score; a ValueError when the tokenizer has none."""
    sep = tokenizer.convert_tokens_to_ids(STEP_TAG)
    if sep is None or sep == tokenizer.unk_token_id:
        raise ValueError(f"{name}: tokenizer has no {STEP_TAG} token")
    return sep


def no_prm_head(name: str) -> ValueError:
    """The error for a checkpoint that is not a process reward model."""
    return ValueError(
        f"{name} has no process-reward head (score.0/score.2 weights), so it cannot score steps; "
        "give a Qwen2ForProcessRewardModel checkpoint such as Qwen/Qwen2.5-Math-PRM-7B"
    )


def _check_prm(prm: LoadedModel) -> int:
    if not prm.is_prm:
        raise no_prm_head(prm.name)
    return step_tag_id(prm.tokenizer, prm.name)


@torch.inference_mode()
def _trajectory_ids(prm: LoadedModel, problem: str, steps: Sequence[str], system: str) -> list[int]:
    """The model card's input for a whole trajectory: chat prompt, then the steps each ending in <extra_0>."""
    content = STEP_TAG.join(prm_step_text(s) for s in steps) + STEP_TAG
    return prm.tokenizer.encode(_prompt_text(prm.tokenizer, problem, system) + content, add_special_tokens=False)


def prm_scores(prm: LoadedModel, problem: str, steps: Sequence[str], system: str = SYSTEM_PROMPT) -> list[float]:
    """From-scratch reference: score of every step of a whole trajectory in one plain forward."""
    sep = _check_prm(prm)
    ids_t = torch.tensor([_trajectory_ids(prm, problem, steps, system)])
    probs = torch.softmax(prm.logits(ids_t)[0], dim=-1)[:, 1]
    return probs[ids_t[0].to(probs.device) == sep].tolist()


def prm_last_scores(prm: LoadedModel, problem: str, trajectories: Sequence[Sequence[str]],
                    system: str = SYSTEM_PROMPT) -> list[float]:
    """From scratch, batched: the last step's score of each trajectory, all in one right-padded forward
    (attention is causal, so no real token sees the padding after it). No prefix is shared or cached."""
    _check_prm(prm)
    rows = [_trajectory_ids(prm, problem, steps, system) for steps in trajectories]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    probs = torch.softmax(prm.logits(ids), dim=-1)[..., 1]
    return [probs[i, len(row) - 1].item() for i, row in enumerate(rows)]


@dataclass
class PRMTrajectory:
    """One problem's PRM input as token ids: its chat prompt, then its committed steps, each ending in <extra_0>."""

    prompt: list[int]
    steps: list[list[int]] = field(default_factory=list)
    kept_from: int = 0  # steps before this index were dropped to fit the window
    processed: int = 0  # tokens the scorer's model processed for this problem
    truncations: int = 0

    def prefix(self) -> list[int]:
        """What the PRM sees before a candidate: the prompt and the kept committed steps."""
        return self.prompt + [t for s in self.steps[self.kept_from :] for t in s]

    def fit(self, need: int, window: int) -> bool:
        """Drop the oldest committed steps until the prefix plus `need` tokens fits the window; True if any went."""
        length, first = len(self.prefix()), self.kept_from
        while self.kept_from < len(self.steps) and length + need > window:
            length -= len(self.steps[self.kept_from])
            self.kept_from += 1
        self.truncations += self.kept_from > first
        return self.kept_from > first


class PRMInputs:
    """The PRM's input token ids of many problems, keyed by problem (no tensors: the scorers own the model).

    Both scorers read their inputs here, so the engine's PRMScorer and vLLM's see the same token ids, the
    same dropped steps and the same cut candidates.
    """

    def __init__(self, tokenizer, sep: int, window: int = WINDOW, system: str = SYSTEM_PROMPT) -> None:
        self.tokenizer = tokenizer
        self.encode = encoder(tokenizer)
        self.sep = sep
        self.window = window
        self.system = system
        self.problems: dict[int, PRMTrajectory] = {}

    def open(self, key: int, problem: str) -> PRMTrajectory:
        """Start a problem: its prompt's ids."""
        ids = self.encode([_prompt_text(self.tokenizer, problem, self.system)])[0]
        self.problems[key] = PRMTrajectory(ids)
        return self.problems[key]

    def step_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Generated steps' ids as the PRM sees them, each ending in <extra_0> (one batched tokenizer call)."""
        return [ids + [self.sep] for ids in self.encode([prm_step_text(text) for text in texts])]

    def candidates(self, requests: Sequence[Request]) -> tuple[list[list[int]], list[int]]:
        """Each candidate's ids (a suffix of its problem's prefix), and the problems whose prefix lost steps
        to make room for their longest candidate."""
        suffixes = self.step_ids([text for _, text, _ in requests])
        need: dict[int, int] = {}
        for (key, _, _), s in zip(requests, suffixes):
            need[key] = max(need.get(key, 0), len(s))
        refit = [key for key, n in need.items() if self.problems[key].fit(n, self.window)]
        room = {key: self.window - len(self.problems[key].prefix()) for key in need}
        # A candidate longer than the window left after dropping every step keeps its end (its <extra_0>).
        return [s[-max(room[key], 1) :] for (key, _, _), s in zip(requests, suffixes)], refit

    def commit(self, key: int, text: str) -> tuple[list[int], bool]:
        """The problem committed this step: its ids, and whether older steps were dropped to fit it."""
        p = self.problems[key]
        step = self.step_ids([text])[0]
        refit = p.fit(len(step), self.window)
        p.steps.append(step)
        return step, refit


class PRMScorer:
    """Scores candidate steps of many problems as suffixes of each problem's cached committed prefix.

    Follows the controller's scorer protocol: open / score / commit / close, keyed by problem. Opening and
    committing only queue tokens: each `score` first feeds every problem's queued tokens in one forward,
    then scores all candidates in another (more only when the cache's room splits them).
    """

    name = "prm"

    @staticmethod
    def cache_tokens(max_problems: int, max_candidates: int, max_step_tokens: int, window: int = WINDOW,
                     block_size: int = TORCH_BLOCK, candidate_tokens: int | None = None) -> int:
        """Token room of a scorer's cache in blocks of `block_size` tokens: every open problem's full window, plus
        candidate suffixes: `candidate_tokens`, by default max_candidates full-length steps (each with the partial
        block it copies from its prefix)."""
        room = max_candidates * (max_step_tokens + block_size + 1) if candidate_tokens is None else candidate_tokens
        return max_problems * (window + block_size) + room

    def __init__(
        self,
        prm: LoadedModel,
        *,
        max_problems: int = 32,
        max_candidates: int = 512,
        max_step_tokens: int = 512,
        window: int = WINDOW,
        candidate_tokens: int | None = None,
        system: str = SYSTEM_PROMPT,
    ) -> None:
        """Cache room as `cache_tokens` counts it; candidates beyond it are scored in several forwards. Blocks as
        the device's attention path takes them (`block_size_for`: flash-attn's paged kernel on a GPU, whose
        256-token blocks make each candidate copy up to 255 tokens of its prefix's partial last block, 15 with
        the torch path's 16)."""
        self.prm = prm
        self.inputs = PRMInputs(prm.tokenizer, _check_prm(prm), window, system)
        bs = block_size_for(next(prm.net.parameters()))
        self.cache = FullCache.for_model(
            prm.net, self.cache_tokens(max_problems, max_candidates, max_step_tokens, window, bs, candidate_tokens),
            block_size=bs, max_rows=max_problems + max_candidates, max_row_tokens=window + bs,
        )
        self.rows: dict[int, int] = {}  # each problem's cache row, holding its prefix
        self.unfed: dict[int, list[int]] = {}  # tokens of a problem's prefix not yet in its row

    def _prefill(self, key: int) -> None:
        """A new row for a problem's prefix (at open, and again after older steps were dropped), fed later."""
        if key in self.rows:
            self.cache.release([self.rows[key]])
        self.rows[key] = self.cache.create()
        self.unfed[key] = self.inputs.problems[key].prefix()

    @torch.inference_mode()
    def _feed(self) -> None:
        """Append every problem's unfed tokens (prompts opened, steps committed since the last score) to its
        row, all problems in one forward."""
        if not self.unfed:
            return
        keys = list(self.unfed)
        append_tokens(self.prm, self.cache, [self.rows[key] for key in keys], [self.unfed[key] for key in keys])
        for key in keys:
            self.inputs.problems[key].processed += len(self.unfed.pop(key))

    def open(self, key: int, problem: str, prompt: list[int] | None = None) -> None:
        """Start following a problem: encode its prompt, cached with the next score's first forward (the
        policy's `prompt` tokens are not needed)."""
        self.inputs.open(key, problem)
        self._prefill(key)

    @torch.inference_mode()
    def score(self, requests: Sequence[Request]) -> list[float]:
        """softmax(head)[1] at each candidate's <extra_0>, all candidates of all problems in one forward."""
        if not requests:
            return []
        suffixes, refit = self.inputs.candidates(requests)
        for key in refit:
            self._prefill(key)
        self._feed()
        scores: list[float] = []
        for chunk in self._chunks(suffixes):
            keys = [requests[i][0] for i in chunk]
            rows = self.cache.fork_each([self.rows[key] for key in keys], 1)
            try:
                head = append_tokens(self.prm, self.cache, rows, [suffixes[i] for i in chunk])
            finally:
                self.cache.release(rows)
            scores += torch.softmax(head, dim=-1)[:, 1].tolist()
            for key, i in zip(keys, chunk):
                self.inputs.problems[key].processed += len(suffixes[i])
        return scores

    def _chunks(self, suffixes: list[list[int]]) -> list[list[int]]:
        """Consecutive groups of candidates whose suffix blocks fit the free cache together."""
        free, bs = self.cache.num_blocks - self.cache.blocks_in_use(), self.cache.block_size
        free_rows = len(self.cache.free_rows)
        chunks: list[list[int]] = [[]]
        used = 0
        for i, s in enumerate(suffixes):
            need = -(-len(s) // bs) + 1  # + the copied partial block of the shared prefix
            if chunks[-1] and (used + need > free or len(chunks[-1]) == free_rows):
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += need
        return chunks

    def commit(self, key: int, text: str, tokens: list[int] | None = None) -> None:
        """The problem committed this step: its ids (and <extra_0>) join the prefix, cached with the next
        score's first forward (a problem closed before then never costs the forward)."""
        step, refit = self.inputs.commit(key, text)
        if refit:
            self._prefill(key)  # the prefix, this step included
        else:
            self.unfed.setdefault(key, []).extend(step)

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens the PRM processed, times its input was truncated)."""
        self.cache.release([self.rows.pop(key)])
        self.unfed.pop(key, None)
        p = self.inputs.problems.pop(key)
        return p.processed, p.truncations

    def dropped_steps(self, key: int) -> int:
        """How many of the oldest committed steps no longer fit the window."""
        return self.inputs.problems[key].kept_from
