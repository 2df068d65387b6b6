"""Step decoding: many rows (problems x candidates) sampled one token per iteration until each ends a step.

This is the one decode loop of the tool (the controller drives it, tests/oracles.py's `generate_steps` too). Per-token
work is done for all rows at once on the model's device: sampling from counter-based streams, step
ends decided from token ids by per-vocabulary tables, the detector's entropy window; on a GPU with CUDA graphs, that
work runs as one captured graph per bucket of live lanes (`step_graphs`). The host sees
one small packed transfer per iteration (tokens, entropies, finish codes), writes it into its
per-row buffers with array operations, and decodes text only where it is needed: once when a step
ends, and for the gzip test only for rows that may hold enough characters.

Convention shared with the `Runner`: when a row finishes, its cache holds every token of its step
except the last one, whose logits nobody needs unless the row is committed; `Runner.commit` feeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvrescue.detect import DetectorConfig, gzip_ratio
from kvrescue.engine.caches import KVCache
from kvrescue.engine.sampling import SamplingParams, as_keys, counter_stages, uniforms
from kvrescue.engine.step_graphs import StaticIterations
from kvrescue.engine.step_table import step_table
from kvrescue.engine.texts import decoder
from kvrescue.engine.transfer import Download, upload
from kvrescue.prompts import STEP_DELIMITER
from kvrescue.reasons import DETECTOR_FINISHES, FINISHES
from kvrescue.shapes import MAX_CONTEXT, MAX_STEP_TOKENS, rows_room

FINISH_CODES = (None, *FINISHES)  # finish codes 0..6 on the device (0: not finished)
_STEP, _EOS, _LENGTH, _ENTROPY, _REPETITION, _NONFINITE = range(1, len(FINISH_CODES))


@dataclass(frozen=True)
class StepRules:
    """How candidate steps are decoded: sampling, when a step ends, and the detector.

    A step ends at EOS, at the delimiter `\\n\\n` in its decoded text, at `max_step_tokens`, or when
    its context reaches `max_context`; `fixed_length` (synthetic throughput runs) ends every step
    after that many tokens and ignores EOS and the delimiter. The detector (None: off) screens the rows
    started with `screened=True`, every token including the last one.
    """

    eos: frozenset[int]
    sampling: SamplingParams = SamplingParams()
    max_step_tokens: int = MAX_STEP_TOKENS
    max_context: int = MAX_CONTEXT
    fixed_length: int | None = None
    detector: DetectorConfig | None = None


@dataclass
class CandidateStep:
    """One row's finished step: tokens, text = decode(tokens), entropies (none from vLLM), finish reason, detector
    extremes."""

    row: int
    tokens: list[int]
    text: str
    entropies: list[float]
    finish: str
    max_mean_entropy: float | None = None
    min_gzip_ratio: float | None = None
    fired_at: int | None = None


@dataclass
class _Lanes:
    """Per-candidate state in lanes (indices reused as candidates finish), on the device and on the host."""

    draws: torch.Tensor     # [lanes, columns] float32: each stream's `sampling.uniforms` for counters 0, 1, ...
    count: torch.Tensor
    prev_ends: torch.Tensor
    ring: torch.Tensor      # the last `ent_window` entropies, float64
    max_mean_entropy: torch.Tensor  # the largest window mean at checked positions, -inf before any
    chars: torch.Tensor     # bound on the decoded characters so far
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    screened: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    context: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # tokens before the step
    tokens: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    entropies: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    min_gzip_ratio: np.ndarray = field(default_factory=lambda: np.zeros(0))


class StepDecoder:
    """The open candidate steps of one runner, advanced together one token per `advance(runner)`.

    The runner (passed in, not kept: a runner holds its decoder, and a reference back would make a cycle that
    keeps a finished cell's caches until a full garbage collection) provides `sample(rows, draws, params)`,
    `decode(rows_tensor, rows, tokens)` (one token appended to each row, its logits kept) and `logits` (the kept
    logits `sample` reads).

    `static`: each iteration runs over the live lanes padded to their bucket, lane 0 kept as the padding's scratch
    lane (`step_graphs`); with `graphs` on CUDA, as captured CUDA graphs (in the memory pool `pool`, None: one of
    their own).
    """

    def __init__(self, device: torch.device, tokenizer, rules: StepRules, static: bool = False,
                 graphs: bool = False, pool=None) -> None:
        self.rules = rules
        self.device = device
        self.table = step_table(tokenizer).to(self.device)
        self.decode_text = decoder(tokenizer)
        self.eos = torch.zeros(len(self.table.contains), dtype=torch.bool, device=self.device)
        eos = [t for t in rules.eos if t < len(self.eos)]
        self.eos[eos] = True
        self.width = rules.max_step_tokens
        # A step's counters stay below its longest length: its uniforms are drawn on the host when it starts (a table
        # of lanes x columns, the same values as drawn token by token, in one copy), one lookup per token.
        columns = min(self.width, rules.fixed_length or self.width)
        self.counters = np.arange(columns)
        self.stages = counter_stages(columns).numpy()
        self.window = rules.detector.ent_window if rules.detector else 1
        self.lanes = self._allocate(0)
        self.free: list[int] = []
        self.scratch = int(static)  # lanes below it are never handed out: lane 0 is the static padding's
        self.live = np.zeros(0, np.int64)   # live lanes, in batch order
        self.static = StaticIterations(device, graphs, pool) if static else None
        # `launch`'s rows and tokens on the device (the live lanes first) and their copy to the host
        self.pending: tuple[torch.Tensor, torch.Tensor, Download] | None = None

    @property
    def busy(self) -> bool:
        """Whether any step is still being decoded."""
        return len(self.live) > 0

    def _allocate(self, size: int) -> _Lanes:
        dev = self.device
        return _Lanes(
            draws=torch.zeros(size, len(self.counters), dtype=torch.float32, device=dev),
            count=torch.zeros(size, dtype=torch.long, device=dev),
            prev_ends=torch.zeros(size, dtype=torch.bool, device=dev),
            ring=torch.zeros(size, self.window, dtype=torch.float64, device=dev),
            max_mean_entropy=torch.full((size,), -torch.inf, dtype=torch.float64, device=dev),
            chars=torch.zeros(size, dtype=torch.long, device=dev),
            rows=np.zeros(size, np.int64), screened=np.zeros(size, bool), counts=np.zeros(size, np.int64),
            context=np.zeros(size, np.int64),
            tokens=np.zeros((size, self.width), np.int64), entropies=np.zeros((size, self.width), np.float32),
            min_gzip_ratio=np.full(size, np.inf),
        )

    def _grow(self, need: int) -> None:
        old = len(self.lanes.rows)
        new = self._allocate(rows_room(need))
        for name, value in vars(self.lanes).items():
            getattr(new, name)[:old] = value
        self.lanes = new
        self.free = list(range(len(new.rows) - 1, max(old, self.scratch) - 1, -1)) + self.free

    def start(self, rows: Sequence[int], keys: Sequence[Sequence[int] | int], contexts: Sequence[int],
              screened: Sequence[bool]) -> None:
        """Open a step on each row (its logits already in the runner): stream keys[i], contexts[i] tokens before it."""
        if self.pending is not None:
            raise RuntimeError("StepDecoder.start: a launched token not yet read (`advance` first)")
        if len(self.free) < len(rows):
            self._grow(max(len(self.lanes.rows), self.scratch) + len(rows) - len(self.free))
        lanes = np.array([self.free.pop() for _ in rows], dtype=np.int64)
        s = self.lanes
        s.rows[lanes], s.screened[lanes], s.counts[lanes], s.min_gzip_ratio[lanes] = rows, screened, 0, np.inf
        s.context[lanes] = contexts
        at = upload(lanes, self.device)
        s.draws[at] = upload(uniforms(as_keys(keys).numpy()[:, None], self.counters, self.stages), self.device)
        s.count[at], s.prev_ends[at], s.ring[at], s.max_mean_entropy[at], s.chars[at] = 0, False, 0.0, -torch.inf, 0
        self.live = np.concatenate([self.live, lanes])

    def launch(self, runner) -> None:
        """Sample one token for every live row of `runner` and start the copy of what the host reads of it (tokens,
        entropies, finish codes), without waiting for it: `advance` reads it. A controller launches every runner's
        sampling before it waits for any, so that one runner's sampling is not queued behind another's forward."""
        if not self.busy or self.pending is not None:
            return
        s, live = self.lanes, self.live
        host = np.stack([live, s.rows[live], s.screened[live]]).astype(np.int64)
        if self.static is None:
            inputs = upload(host, self.device)
            detect = self.rules.detector is not None and bool(s.screened[live].any())
            tokens, packed = self._iterate(runner, inputs, detect)
        else:
            inputs, tokens, packed = self.static(self._iterate, runner, host, (s.draws, runner.logits))
        self.pending = (inputs[1, : len(live)], tokens[: len(live)], Download(packed))

    def _iterate(self, runner, inputs: torch.Tensor, detect: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each column of `inputs` = [lanes, rows, screened flags] (int64 [3, size]) with every lane's
        state updated: the tokens and the packed float64 [5, size] the host reads (tokens, entropies, finish codes,
        largest window means, whether the host checks the text). The one implementation of the sampling, step-end and
        detector rules, eager or captured (`step_graphs`); `detect`: the detector's work (off where no row is
        screened), always on in static shapes."""
        rules, table, s = self.rules, self.table, self.lanes
        lanes, screened = inputs[0], inputs[2].bool()
        count = s.count[lanes]
        # a padding column's scratch lane counts on past the draws: clamped, as its results are never read
        draws = s.draws[lanes, count.clamp(max=len(self.counters) - 1)]
        tokens, entropies = runner.sample(inputs[1], draws, rules.sampling)
        n = count + 1
        s.count[lanes] = n
        code = torch.zeros_like(tokens)  # the ends read on the device; the length ends are the host's (counts)
        if rules.fixed_length is None:
            delimiter = table.contains[tokens] | (s.prev_ends[lanes] & table.starts[tokens])
            s.prev_ends[lanes] = table.ends[tokens]
            if table.exact:
                code.masked_fill_(delimiter, _STEP)
            code.masked_fill_(self.eos[tokens], _EOS)
        check_text = torch.zeros_like(tokens, dtype=torch.bool)
        cfg = rules.detector
        if cfg is not None and detect:
            ring = s.ring[lanes]
            ring[torch.arange(len(lanes), device=self.device), (n - 1) % cfg.ent_window] = entropies.double()
            s.ring[lanes] = ring
            mean = ring.sum(-1) / n.clamp(max=cfg.ent_window)
            checked = screened & (n >= cfg.min_tokens)
            held = s.max_mean_entropy[lanes]
            s.max_mean_entropy[lanes] = torch.where(checked, torch.maximum(held, mean), held)
            code.masked_fill_(checked & (mean > cfg.tau_ent), _ENTROPY)
            chars = s.chars[lanes] + table.chars[tokens]
            s.chars[lanes] = chars
            check_text = screened & (chars >= cfg.cmp_chars)
        code.masked_fill_(entropies.isnan(), _NONFINITE)  # a NaN or +inf logit: its token is meaningless
        if not table.exact:
            check_text |= (code == 0) & table.newline[tokens]
        packed = torch.stack([tokens.double(), entropies.double(), code.double(), s.max_mean_entropy[lanes],
                              check_text.double()])
        return tokens, packed

    def advance(self, runner) -> list[CandidateStep]:
        """One token for every live row of `runner` (sampled by `launch`, or now), fed to the rows that go on; the
        steps that ended."""
        if not self.busy:
            return []
        self.launch(runner)
        (rows_t, tokens, download), self.pending = self.pending, None
        rules, s, live = self.rules, self.lanes, self.live
        packed = download.wait()[:, : len(live)]  # the iteration's one synchronisation
        tok = packed[0].astype(np.int64)
        s.counts[live] += 1
        s.tokens[live, s.counts[live] - 1] = tok
        s.entropies[live, s.counts[live] - 1] = packed[1]
        codes = packed[2].astype(np.int64)
        n = s.counts[live]
        if rules.fixed_length is not None:
            codes[(codes == 0) & (n >= rules.fixed_length)] = _STEP
        codes[(codes == 0) & ((n >= rules.max_step_tokens) | (s.context[live] + n >= rules.max_context))] = _LENGTH
        for i in np.flatnonzero(packed[4]):
            codes[i] = self._check_text(live[i], codes[i])
        ended = codes != 0
        finished = [(live[i], FINISH_CODES[codes[i]], packed[3][i]) for i in np.flatnonzero(ended)]
        self.free += live[ended].tolist()
        self.live = live[~ended]
        if self.busy:
            if ended.any():
                at = upload(np.flatnonzero(~ended), self.device)
                rows_t, tokens = rows_t[at], tokens[at]
            runner.decode(rows_t, s.rows[self.live].tolist(), tokens)
        # Built after the forward is launched: on a GPU it runs while the host decodes the finished steps' texts
        # (their lanes are free, but nothing reuses them before the next `start`).
        return [self._finished(*f) for f in finished]

    def _check_text(self, lane: int, code: int) -> int:
        """Host checks on the decoded text of one row: the gzip test, and the delimiter for an inexact table."""
        s, cfg = self.lanes, self.rules.detector
        n = s.counts[lane]
        text = self.decode_text(s.tokens[lane, :n].tolist())
        if code == 0 and not self.table.exact and STEP_DELIMITER in text:
            code = _STEP
        if cfg is not None and s.screened[lane]:
            text = text.rstrip("\ufffd")  # an incomplete character at the end is not text yet
            if len(text) >= cfg.cmp_chars:
                ratio = gzip_ratio(text[-cfg.cmp_chars:], cfg.gzip_level)
                s.min_gzip_ratio[lane] = min(s.min_gzip_ratio[lane], ratio)
                if ratio < cfg.tau_cmp and code not in (_ENTROPY, _NONFINITE):
                    code = _REPETITION
        return code

    def _finished(self, lane: int, finish: str, max_mean_entropy: float) -> CandidateStep:
        s = self.lanes
        n = s.counts[lane]
        tokens = s.tokens[lane, :n].tolist()
        screened = bool(s.screened[lane])
        return CandidateStep(
            row=int(s.rows[lane]), tokens=tokens, text=self.decode_text(tokens),
            entropies=s.entropies[lane, :n].tolist(), finish=finish,
            max_mean_entropy=float(max_mean_entropy) if screened and max_mean_entropy > -np.inf else None,
            min_gzip_ratio=float(s.min_gzip_ratio[lane]) if screened and s.min_gzip_ratio[lane] < np.inf else None,
            fired_at=int(n) if finish in DETECTOR_FINISHES else None,
        )


@torch.inference_mode()
def append_tokens(model, cache: KVCache, rows: Sequence[int], token_lists: Sequence[Sequence[int]],
                  last_only: bool = True) -> torch.Tensor:
    """Append token_lists[i] (non-empty) to rows[i] of a `LoadedModel`'s cache in one forward (right padded).

    Returns fp32 head outputs after each row's last token [R, V], or at every position [R, T, V].
    """
    tokens, n_new = padded_tokens(token_lists, model.device)
    return model.net.prefill(tokens, cache, list(rows), n_new, last_only).float()


def padded_tokens(token_lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The lists (each non-empty) right padded into one batch [R, T] on `device`, and their lengths."""
    n_new = [len(t) for t in token_lists]
    if min(n_new) < 1:
        raise ValueError("append_tokens: every row needs at least one token")
    batch = np.zeros((len(token_lists), max(n_new)), np.int64)
    for i, tokens in enumerate(token_lists):
        batch[i, : len(tokens)] = tokens
    return upload(batch, device), n_new
