"""Process reward scoring (DESIGN section 5) with a cached committed prefix.

The input and the score are a recipe's (engine/prm_recipes: Qwen2.5-Math-PRM's `paper` or `model-card`, RLHFlow,
Math-Shepherd, Skywork), read at the last token of a candidate's piece. Each problem's committed prefix lives in one
FullCache row; a candidate is scored as a suffix (fork, append its piece's tokens, read the head), all candidates of
all problems in one forward (on a GPU with CUDA graphs on, a static forward captured per bucket of rows, tokens and
blocks: `graphs.StaticDecode.append`). The forks are kept until their problem commits: the winner's row becomes its
prefix row (its K/V are the committed step's), the others are released.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kvrescue.engine.invariance as invariance
from kvrescue.engine.caches import TORCH_BLOCK, FullCache, block_size_for
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import LoadedModel
from kvrescue.engine.prm_recipes import FORMATS, HEADS, PRMRecipe, RecipeInputs
from kvrescue.engine.scoring import PendingScores, Request
from kvrescue.engine.steps import append_tokens
from kvrescue.engine.streams import ModelStream, on_stream
from kvrescue.model_config import window_error
from kvrescue.prompts import SYSTEM_PROMPT
from kvrescue.scorers import PRM
from kvrescue.shapes import PRM_WINDOW


def no_prm_head(name: str) -> ValueError:
    """The error for a checkpoint that is not a process reward model."""
    return ValueError(
        f"{name} has no process-reward head (score.0/score.2 weights), so it cannot score steps; "
        "give a Qwen2ForProcessRewardModel checkpoint such as Qwen/Qwen2.5-Math-PRM-7B"
    )


def check_prm(prm: LoadedModel, recipe: PRMRecipe, window: int = PRM_WINDOW) -> RecipeInputs:
    """The recipe bound to the PRM's tokenizer; a ValueError when the PRM lacks the recipe's head, its tokenizer
    cannot take the recipe, or its attention cannot see the window in full."""
    if prm.head_kind != recipe.head:
        if recipe.head == "classes":
            raise no_prm_head(prm.name)
        raise ValueError(f"{prm.name} has {HEADS[prm.head_kind]}, but the {recipe.name} recipe reads "
                         f"{HEADS[recipe.head]} ({recipe.architecture})")
    reason = window_error(prm.config, window)
    if reason:
        raise ValueError(f"{prm.name}: {reason}")
    return recipe.bind(prm.tokenizer, prm.name)


def seen_candidates(suffixes: Sequence[list[int]]) -> list[int]:
    """The indices of the candidates the PRM sees: those whose piece has a token. A step its tokenizer makes nothing
    of (a whitespace-splitting tokenizer's, for a step of spaces and newlines) has no position to read a score at:
    the scorers return None for it, and the controller gives it the lowest score (`scoring.UNSEEN_SCORE`)."""
    return [i for i, suffix in enumerate(suffixes) if suffix]


@dataclass
class PRMTrajectory:
    """One problem's PRM input as token ids: its prompt, then its committed steps' pieces (the recipe's)."""

    prompt: list[int]
    steps: list[list[int]] = field(default_factory=list)
    kept_from: int = 0  # steps before this index were dropped to fit the window
    unfed: list[int] = field(default_factory=list)  # prefix tokens the scorer's model has not processed yet
    rebuilt: bool = True  # `unfed` is the whole prefix (just opened, or older steps were dropped since)
    processed: int = 0  # tokens the scorer's model processed for this problem
    scored: list[list[int]] = field(default_factory=list)  # the pieces of its last scoring, until its next commit
    truncations: int = 0  # scorings and commits that cut its input to the window

    def prefix(self) -> list[int]:
        """What the PRM sees before a candidate: the prompt and the kept committed steps."""
        return self.prompt + [t for s in self.steps[self.kept_from :] for t in s]

    def fit(self, need: int, window: int) -> bool:
        """Drop the oldest committed steps until the prefix plus `need` tokens fits the window (the whole prefix is
        then unfed again); True if any went."""
        length, first = len(self.prefix()), self.kept_from
        while self.kept_from < len(self.steps) and length + need > window:
            length -= len(self.steps[self.kept_from])
            self.kept_from += 1
        if self.kept_from > first:
            self.unfed, self.rebuilt = self.prefix(), True
        return self.kept_from > first


class PRMInputs:
    """The PRM's input token ids of many problems, keyed by problem (no tensors: the scorers own the model).

    Both scorers read their inputs here, so the engine's PRMScorer and vLLM's see the same token ids, the
    same dropped steps and the same cut candidates, and count the same tokens: a committed prefix once, when it
    is first fed (`take_unfed`), and every candidate's piece; a committed step that is one of its last scoring's
    pieces was processed then, and is not fed again (`commit`).
    """

    def __init__(self, tokenizer, recipe: PRMRecipe, window: int = PRM_WINDOW, system: str = SYSTEM_PROMPT,
                 name: str = "the PRM") -> None:
        """`name`: the PRM, for the ValueError raised when its tokenizer cannot take the recipe."""
        self.codec = recipe.bind(tokenizer, name)  # the recipe on this tokenizer: ids in, scores out
        self.window = window
        self.system = system
        self.problems: dict[int, PRMTrajectory] = {}

    def open(self, key: int, problem: str) -> PRMTrajectory:
        """Start a problem: its prompt's ids."""
        ids = self.codec.prompt(problem, self.system)
        self.problems[key] = PRMTrajectory(ids, unfed=list(ids))
        return self.problems[key]

    def step_ids(self, texts: Sequence[str], index: int = 0) -> list[list[int]]:
        """Generated steps' pieces as candidates after `index` committed steps (one batched tokenizer call where the
        recipe allows); each ends where its score is read."""
        return self.codec.candidates(texts, [index] * len(texts))

    def candidates(self, requests: Sequence[Request]) -> list[list[int]]:
        """Each candidate's ids (a suffix of its problem's prefix), older steps dropped to make room for a
        problem's longest candidate; counted as processed."""
        suffixes = self.codec.candidates([text for _, text, _ in requests],
                                         [len(self.problems[key].steps) for key, _, _ in requests])
        need: dict[int, int] = {}
        for (key, _, _), s in zip(requests, suffixes):
            need[key] = max(need.get(key, 0), len(s))
        room = {}
        for key, n in need.items():
            p = self.problems[key]
            dropped = p.fit(n, self.window)
            room[key] = self.window - len(p.prefix())
            p.truncations += dropped or n > room[key]
        # A candidate longer than the window left after dropping every step keeps its end (where it is scored).
        cut = [s[-max(room[key], 1) :] for (key, _, _), s in zip(requests, suffixes)]
        for key in need:
            self.problems[key].scored = []
        for (key, _, _), s in zip(requests, cut):
            self.problems[key].processed += len(s)
            self.problems[key].scored.append(s)
        return cut

    def commit(self, key: int, text: str, kept: Sequence[list[int]] | None = None) -> int | None:
        """The problem committed this step: its ids join the prefix (older steps dropped to fit it), queued to be
        fed unless its last scoring processed them: the step is a piece of `kept` (those of its last scoring's
        pieces whose K/V the scorer kept; None: all, as a prefix cache keeps them), scored after the whole prefix
        as it stands. Returns that piece's index in `kept`."""
        p = self.problems[key]
        step = self.codec.committed(text, len(p.steps))
        dropped = p.fit(len(step), self.window)
        p.truncations += dropped
        p.steps.append(step)
        kept = p.scored if kept is None else kept
        p.scored = []
        if not dropped and not p.unfed and step in kept:
            return kept.index(step)
        p.unfed += step
        return None

    def take_unfed(self) -> list[tuple[int, list[int], bool]]:
        """(key, tokens, rebuilt) of every problem whose prefix has tokens not processed yet (`rebuilt`: they are
        the whole prefix), counted as processed from now on."""
        fed = []
        for key, p in self.problems.items():
            if p.unfed:
                fed.append((key, p.unfed, p.rebuilt))
                p.processed += len(p.unfed)
                p.unfed, p.rebuilt = [], False
        return fed

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens processed, times its input was cut to the window)."""
        p = self.problems.pop(key)
        return p.processed, p.truncations


class PRMScorer:
    """Scores candidate steps of many problems as suffixes of each problem's cached committed prefix.

    Follows the controller's scorer protocol: open / score / commit / close, keyed by problem. Opening queues a
    prompt, fed by the next `score`, in a forward of its own; the candidates of all problems go in one forward
    (more only when the cache's room splits them), and each problem's forks are held until it commits: the
    winner's row becomes its prefix row, so a committed step costs no forward (a step the recipe writes otherwise
    than its candidate, RLHFlow's, and any step after its problem's candidates were split, is queued and fed with
    the next candidates).
    """

    name = PRM

    @staticmethod
    def cache_tokens(max_problems: int, max_candidates: int, max_step_tokens: int, window: int = PRM_WINDOW,
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
        window: int = PRM_WINDOW,
        candidate_tokens: int | None = None,
        system: str = SYSTEM_PROMPT,
        recipe: PRMRecipe = FORMATS["paper"],
        stream: ModelStream | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """Cache room as `cache_tokens` counts it; candidates beyond it are scored in several forwards. Blocks as
        the device's attention path takes them (`block_size_for`: flash-attn's paged kernel on a GPU, whose
        256-token blocks make each candidate copy up to 255 tokens of its prefix's partial last block, 15 with
        the torch path's 16). `stream`: where its work goes (`streams.ModelStream.of`; None: the current stream).
        `cuda_graphs`: on a GPU, the committed steps' and the candidates' forwards run in static shapes, captured in
        CUDA graphs (`graphs.StaticDecode.append`; not with batch invariance on)."""
        check_prm(prm, recipe, window)
        self.prm = prm
        self.inputs = PRMInputs(prm.tokenizer, recipe, window, system, prm.name)
        bs = block_size_for(next(prm.net.parameters()))
        self.cache = FullCache.for_model(
            prm.net, self.cache_tokens(max_problems, max_candidates, max_step_tokens, window, bs, candidate_tokens),
            block_size=bs, max_rows=max_problems + max_candidates, max_row_tokens=window + bs,
        )
        graphed = cuda_graphs and prm.device.type == "cuda" and not invariance.on()
        self.static = StaticDecode(prm.net, self.cache) if graphed else None  # before any row holds a block
        self.rows: dict[int, int] = {}  # each problem's cache row, holding its prefix
        self.held: dict[int, tuple[list[int], list[list[int]]]] = {}  # key -> its last scoring's rows and pieces
        self.stream = stream or ModelStream()
        self.stream.follow()  # the weights and the cache were made on the default stream

    def _unfed(self) -> tuple[list[int], list[list[int]], list[bool]]:
        """Every problem's unfed tokens (prompts opened, steps committed since the last score), the row they go to (a
        new one where they are the whole prefix) and whether they are (`rebuilt`)."""
        unfed = self.inputs.take_unfed()
        for key, _, rebuilt in unfed:
            if rebuilt:
                if key in self.rows:
                    self.cache.release([self.rows[key]])
                self.rows[key] = self.cache.create()
        return ([self.rows[key] for key, _, _ in unfed], [tokens for _, tokens, _ in unfed],
                [rebuilt for _, _, rebuilt in unfed])

    def open(self, key: int, problem: str, prompt: list[int] | None = None) -> None:
        """Start following a problem: encode its prompt, fed by the next score (the
        policy's `prompt` tokens are not needed)."""
        self.inputs.open(key, problem)

    def score(self, requests: Sequence[Request]) -> list[float | None]:
        """The scores of `launch`, waited for."""
        return self.launch(requests).wait()

    @on_stream
    @torch.inference_mode()
    def launch(self, requests: Sequence[Request]) -> PendingScores:
        """The recipe's score at each candidate's last token, all candidates of all problems in one forward, which
        also feeds the problems' unfed tokens where none is longer than the longest candidate (a committed step:
        the candidates are forked from the room made for them, `FullCache.reserve`; a longer one, a prompt, is fed
        in a forward of its own rather than padding every candidate to it); read later, without waiting for the
        device now. With batch invariance on, always in a forward of their own: whether a prefix shares its
        candidates' forward depends on the other problems', and it would join their cascade group. In static shapes
        (`cuda_graphs` on a GPU, batch invariance off), the committed steps still to feed in a static forward of their
        own before the candidates' (`_feed_static`). The candidates' rows are held until their problem commits
        (`commit`), where they went in one forward. None for a candidate whose piece the PRM's tokenizer makes no
        token of (`seen_candidates`)."""
        if not requests:
            return PendingScores(0, [], None)
        self._drop_held({key for key, _, _ in requests})
        suffixes = self.inputs.candidates(requests)
        fed_rows, fed, rebuilt = self._unfed()
        seen = seen_candidates(suffixes)
        static = self.static is not None and not invariance.on()
        if static:
            self._feed_static(fed_rows, fed, rebuilt)
            fed_rows, fed = [], []
        elif fed and (not seen or invariance.on() or max(map(len, fed)) > max(len(suffixes[i]) for i in seen)):
            append_tokens(self.prm, self.cache, fed_rows, fed)
            fed_rows, fed = [], []
        self.cache.reserve(fed_rows, [len(tokens) for tokens in fed])
        order, scores = [], []
        chunks = self._chunks([suffixes[i] for i in seen])
        hold = len(chunks) == 1  # the forks are released by their problem's commit (or close), not here
        for chunk in chunks:
            picked = [seen[j] for j in chunk]
            rows = self.cache.fork_each([self.rows[requests[i][0]] for i in picked], 1)
            pieces = [suffixes[i] for i in picked]
            if hold:
                for i, row, piece in zip(picked, rows, pieces):
                    held_rows, held_pieces = self.held.setdefault(requests[i][0], ([], []))
                    held_rows.append(row)
                    held_pieces.append(piece)
            try:
                if static:
                    head = self.static.append(rows, pieces).float()
                else:
                    head = append_tokens(self.prm, self.cache, fed_rows + rows, fed + pieces)
            finally:
                if not hold:
                    self.cache.release(rows)
            order += picked
            scores.append(self.inputs.codec.read(head[len(fed_rows):]))
            fed_rows, fed = [], []
        return PendingScores(len(suffixes), order, torch.cat(scores) if scores else None)

    def _feed_static(self, rows: list[int], tokens: list[list[int]], rebuilt: list[bool]) -> None:
        """Feed the unfed tokens before the candidates are forked: whole prefixes (prompts: long, once a problem)
        eagerly, committed steps in a static forward of their own (the candidates' forks then copy a partly filled
        last block that is complete)."""
        for whole in (True, False):
            picked = [i for i, r in enumerate(rebuilt) if r == whole]
            if not picked:
                continue
            at, lists = [rows[i] for i in picked], [tokens[i] for i in picked]
            if whole:
                append_tokens(self.prm, self.cache, at, lists)
            else:
                self.static.append(at, lists)

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
        return chunks if suffixes else []

    def commit(self, key: int, text: str, tokens: list[int] | None = None) -> None:
        """The problem committed this step: its ids join the prefix. Where its last scoring's candidate of these
        ids is held, that row becomes the problem's (`PRMInputs.commit`); otherwise they are fed by the next score
        (a problem closed before then never costs the forward)."""
        rows, pieces = self.held.pop(key, ([], []))
        at = self.inputs.commit(key, text, pieces)
        if at is not None:
            self.cache.adopt(self.rows[key], rows.pop(at))
        self.cache.release(rows)

    def _drop_held(self, keys) -> None:
        """Release the candidates' rows held for these problems."""
        for key in keys:
            self.cache.release(self.held.pop(key, ([], []))[0])

    @on_stream
    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens the PRM processed, times its input was cut to the window)."""
        self._drop_held([key])
        if key in self.rows:
            self.cache.release([self.rows.pop(key)])
        return self.inputs.close(key)
