"""The one door to a model and its cache (nano-vllm's model runner): rows, logits, sampling, commits.

The controller decides (which rows to fork, which candidate wins); the Runner does the tensor work.
It keeps every row's latest next-token logits in one device buffer indexed by row, so forks, sampling
and decoding never move logits through the host, and it owns two rules of the cache: a finished step's
last token is not yet fed (`commit` feeds it), and after a commit a row holds exactly its trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import kvrescue.engine.invariance as invariance
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache, KVCache
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import LoadedModel
from kvrescue.engine.sampling import SamplingParams, sample_drawn
from kvrescue.engine.steps import CandidateStep, StepDecoder, StepRules, append_tokens
from kvrescue.engine.streams import ModelStream, on_stream
from kvrescue.engine.tp import from_rank_0
from kvrescue.engine.transfer import upload, upload_all
from kvrescue.shapes import ROWS_ROOM, rows_room


class Runner:
    """One model with one cache: prefill, fork/adopt/release, candidate steps (`start`/`advance`), commit."""

    def __init__(self, model: LoadedModel, cache: KVCache, cuda_graphs: bool = False,
                 stream: ModelStream | None = None, static_sampling: bool | None = None) -> None:
        """`cuda_graphs`: on a GPU, the one-token steps (on a bounded or a full cache) and each decode iteration's
        sampling run as captured CUDA graphs, and on a full cache the commits of several tokens a row too (not with
        batch invariance on). `stream`: where its work goes (`streams.ModelStream.of`; None: the current stream).
        `static_sampling`: the sampling in static shapes (`steps.StepDecoder`), captured where `cuda_graphs` are;
        None: wherever it is captured (not under `--tp` with copies of the model, whose tokens come from rank 0
        through a collective)."""
        self.model = model
        self.cache = cache
        self.tokenizer = model.tokenizer
        self.device = model.device
        self.vocab = len(model.tokenizer)  # logits past it are padding (Qwen2.5 pads its embeddings): never sampled
        graphed = cuda_graphs and isinstance(cache, BoundedCache | FullCache) and model.device.type == "cuda"
        self.static = StaticDecode(model.net, cache) if graphed else None
        self.sample_graphs = cuda_graphs and model.device.type == "cuda" and not model.net.shard.copied
        self.static_sampling = self.sample_graphs if static_sampling is None else static_sampling
        self.logits: torch.Tensor | None = None  # [rows, V]: each row's next-token logits
        self.trajectory: dict[int, int] = {}     # committed tokens of each row (prompt + committed steps)
        self.steps: StepDecoder | None = None
        self.decoded = 0  # candidate tokens sampled so far
        self.stream = stream or ModelStream()
        self.stream.follow()  # the model's weights and the cache were made on the default stream

    # -- rows -----------------------------------------------------------------------------------------
    @on_stream
    def prefill(self, token_lists: Sequence[Sequence[int]]) -> list[int]:
        """New rows holding token_lists[i] (prompts), in one forward."""
        rows = [self.cache.create() for _ in token_lists]
        self._keep(rows, self.append(rows, token_lists))
        for row, tokens in zip(rows, token_lists):
            self.trajectory[row] = len(tokens)
        return rows

    def fork(self, row: int, n: int) -> list[int]:
        """n children of a committed row, each with its content and next-token logits."""
        return self.fork_each([row], n)

    @on_stream
    def fork_each(self, rows: Sequence[int], n: int) -> list[int]:
        """n children of each committed row, row after row, in one pass."""
        children = self.cache.fork_each(rows, n)
        if children:
            self._room(max(children) + 1)
            parents = np.repeat(np.asarray(rows, np.int64), n)
            index = upload_all({"children": np.asarray(children, np.int64), "parents": parents}, self.device)
            self.logits.index_copy_(0, index["children"], self.logits.index_select(0, index["parents"]))
            for child, parent in zip(children, parents.tolist()):
                self.trajectory[child] = self.trajectory[parent]
        return children

    @on_stream
    def adopt(self, row: int, child: int) -> None:
        """The committed row takes a candidate's cache (its step, minus the last token); the child is released."""
        self.cache.adopt(row, child)
        del self.trajectory[child]

    @on_stream
    def release(self, rows: Sequence[int]) -> None:
        """Free rows."""
        self.cache.release(rows)
        for row in rows:
            del self.trajectory[row]

    def length(self, row: int) -> int:
        """Tokens the row's cache holds."""
        return self.cache.length(row)

    def peak_length(self, row: int) -> int:
        """The largest physical length this row (and the forks it adopted) reached."""
        return self.cache.peak_length(row)

    @on_stream
    def commit(self, rows: Sequence[int], steps: Sequence[Sequence[int]]) -> None:
        """Append committed steps[i] to rows[i] in one forward: all of it, or only its last token where the row
        adopted the candidate that decoded it; then each row must hold exactly its trajectory."""
        tails = []
        for row, step in zip(rows, steps):
            held = self.cache.length(row) - self.trajectory[row]
            if held not in (0, len(step) - 1):
                raise RuntimeError(f"row {row}: its cache holds {held} tokens past the trajectory, the step has {len(step)}")
            tails.append(step[held:])
            self.trajectory[row] += len(step)
        if rows and self.static is not None and all(len(tail) == 1 for tail in tails):
            tokens = upload(np.asarray([tail[0] for tail in tails], np.int64), self.device)
            self._keep(rows, self.static(list(rows), tokens))  # every row adopted its step: one static decode step
        elif rows and self.static is not None and isinstance(self.cache, FullCache) and not invariance.on():
            self._keep(rows, self.static.append(list(rows), tails))  # one static forward of the steps (the helper's)
        elif rows:
            self._keep(rows, self.append(rows, tails))
        for row in rows:
            if self.cache.length(row) != self.trajectory[row]:
                raise RuntimeError(f"row {row}: the cache holds {self.cache.length(row)} tokens, "
                                   f"the trajectory {self.trajectory[row]}")

    # -- candidate steps ------------------------------------------------------------------------------
    @on_stream
    def start(self, rows: Sequence[int], keys: Sequence[Sequence[int] | int], contexts: Sequence[int],
              screened: Sequence[bool], rules: StepRules) -> None:
        """Open a candidate step on each row (forked from a committed row): stream keys[i], context length
        contexts[i]; the detector screens rows with screened[i]."""
        if self.steps is None or self.steps.rules != rules:
            if self.steps is not None and self.steps.busy:
                raise RuntimeError("Runner.start: other rules while steps are open")
            self.steps = StepDecoder(self.device, self.tokenizer, rules, self.static_sampling, self.sample_graphs,
                                     self.static.memory if self.static is not None else None)
        self.steps.start(rows, keys, contexts, screened)

    @property
    def busy(self) -> bool:
        """Whether candidate steps are still being decoded."""
        return self.open_steps > 0

    @property
    def open_steps(self) -> int:
        """Candidate steps being decoded (each gets a token per `advance`)."""
        return 0 if self.steps is None else len(self.steps.live)

    @on_stream
    def prepare(self) -> None:
        """Launch the next `advance`'s sampling and the copy of its tokens to the host, without waiting for them: a
        controller prepares every runner before it advances any (`StepDecoder.launch`)."""
        if self.steps is not None:
            self.steps.launch(self)

    @on_stream
    def advance(self, wait: bool = False) -> list[CandidateStep]:
        """One token for every open candidate step; the steps that ended with it (`wait`: no effect, every call
        decodes)."""
        self.decoded += self.open_steps
        return self.steps.advance(self) if self.steps is not None else []

    # -- tensors --------------------------------------------------------------------------------------
    def sample(self, rows: torch.Tensor, draws: torch.Tensor,
               params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from its kept logits (rows: int64 device tensor) and its stream's uniform (draws: float32,
        `sampling.uniforms`): tokens, entropies. Under `--tp` with copies of the model on other ranks
        (`Shard.copied`), rank 0's tokens and entropies."""
        tokens, entropies = sample_drawn(self.logits.index_select(0, rows)[:, : self.vocab], draws, params)
        if self.model.net.shard.copied:
            return from_rank_0(tokens.contiguous()), from_rank_0(entropies.contiguous())
        return tokens, entropies

    @torch.inference_mode()
    def decode(self, rows_t: torch.Tensor, rows: list[int], tokens: torch.Tensor) -> None:
        """Append one token (a device tensor) to each row and keep the logits that follow."""
        if self.static is not None:
            out = self.static(rows, tokens)
        else:
            out = self.model.net.decode(tokens, self.cache, rows)
        self.logits.index_copy_(0, rows_t, out.to(self.logits.dtype))

    def rows_held(self, row: int) -> int:
        """Entries this row's cache holds now: its physical length (the logical one for a full cache)."""
        physical = getattr(self.cache, "physical_length", None)
        return physical(row) if physical is not None else self.cache.length(row)

    @on_stream
    def append(self, rows: Sequence[int], token_lists: Sequence[Sequence[int]], last_only: bool = True) -> torch.Tensor:
        """Append token_lists[i] to rows[i] in one forward; the fp32 head outputs after each row's last token
        [R, V] (or at every position, [R, T, V]). For scorers; the kept logits are not touched."""
        return append_tokens(self.model, self.cache, rows, token_lists, last_only)

    def _keep(self, rows: Sequence[int], logits: torch.Tensor) -> None:
        if self.logits is None:
            self.logits = logits.new_zeros(ROWS_ROOM, logits.shape[-1])
        self._room(max(rows) + 1)
        self.logits[upload(torch.tensor(list(rows)), self.device)] = logits

    def _room(self, rows: int) -> None:
        """Grow the logits buffer to hold row ids below `rows` (`shapes.rows_room`)."""
        have = self.logits.shape[0]
        if rows > have:
            grown = self.logits.new_zeros(rows_room(rows), self.logits.shape[1])
            grown[:have] = self.logits
            self.logits = grown
