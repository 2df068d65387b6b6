"""Candidate steps on vLLM (`--engine vllm`): a `StepRunner` whose rows are token prefixes.

vLLM cannot evict mid-generation, so it serves the full-context roles only (the helper; the base of
`full`); the evicted base stays on this engine. A row is its trajectory as token ids (prompt +
committed steps). Opening a step submits one request per candidate from that exact prefix, sampled
with the run's temperature / top-p / top-k and a seed derived from the candidate's stream key (so a
run is reproducible), ending at the step delimiter, EOS, the step cap or the context cap; prefix
caching shares a problem's prefix between its candidates and its steps. The requests decode in vLLM's
engine process while this one decodes the base: `advance` collects the steps that ended, waiting only
when asked to (nothing else decodes). vLLM draws from its own random streams, so its candidates match
this engine's in distribution, not token for token.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence
from typing import Any

from kvrescue.engine.sampling import stream_key
from kvrescue.engine.steps import CandidateStep, StepRules
from kvrescue.prompts import STEP_DELIMITER
from kvrescue.reasons import EOS, LENGTH, STEP

_STOP = object()  # tells the stepping thread to end
_REQUEST_IDS = itertools.count()  # vLLM request ids, unique in this process


class SteppedEngine:
    """A vLLM `LLMEngine` (`llm.start_llm(...).llm_engine`, prefix caching on) stepped by a background thread:
    requests go in without blocking, finished outputs come out. Only that thread touches the engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # (request id, prompt tokens, SamplingParams) or _STOP
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # finished RequestOutputs, or the exception that ended the thread
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="vllm-steps", daemon=True)
        self.thread.start()

    def submit(self, requests: list[tuple[str, list[int], Any]]) -> None:
        """Queue requests (id, prompt token ids, vllm.SamplingParams); they start at the engine's next step."""
        for request in requests:
            self.inbox.put(request)

    def finished(self, wait: bool) -> list:
        """The requests that finished since the last call; with `wait`, at least one (blocks until then)."""
        if self.failure is None:
            done = [self.outbox.get()] if wait else []
            while True:
                try:
                    done.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            self.failure = next((item for item in done if isinstance(item, BaseException)), None)
        if self.failure is not None:  # the thread has ended: every later call says why
            raise RuntimeError(f"vLLM engine stopped: {type(self.failure).__name__}: {self.failure}") from self.failure
        return done

    def close(self) -> None:
        """End the stepping thread and shut the engine's processes down."""
        self.inbox.put(_STOP)
        self.thread.join(timeout=60)  # it ends at its next step; a dead engine core ends it with an error
        self.engine.engine_core.shutdown()

    def _loop(self) -> None:
        from vllm import TokensPrompt

        try:
            while True:
                # Nothing running: sleep until a request (or the end) arrives; else take what is queued.
                items = [] if self.engine.has_unfinished_requests() else [self.inbox.get()]
                while True:
                    try:
                        items.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is _STOP:
                        return
                    request_id, prompt, params = item
                    self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
                for output in self.engine.step():
                    if output.finished:
                        self.outbox.put(output)
        except BaseException as err:  # the caller sees it at its next `finished`
            self.outbox.put(err)


class VllmRunner:
    """The `StepRunner` of a full-context role on vLLM: rows are token prefixes, steps decode in vLLM's process."""

    def __init__(self, engine: SteppedEngine, tokenizer) -> None:
        """`tokenizer`: the role's tokenizer, which decodes each step's tokens into its text."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.rows: dict[int, tuple[int, ...]] = {}  # each row's trajectory: prompt + committed steps
        # request id -> (row, rules, stream key, context, the step's tokens before this request)
        self.in_flight: dict[str, tuple[int, StepRules, Sequence[int] | int, int, list[int]]] = {}
        self.decoded = 0  # candidate tokens of the steps returned so far
        self._ids = itertools.count()

    # -- rows -----------------------------------------------------------------------------------------
    def _new(self, tokens: tuple[int, ...]) -> int:
        row = next(self._ids)
        self.rows[row] = tokens
        return row

    def prefill(self, token_lists: Sequence[Sequence[int]]) -> list[int]:
        """New rows holding token_lists[i]; vLLM prefills each prefix with the first request on it."""
        return [self._new(tuple(tokens)) for tokens in token_lists]

    def fork(self, row: int, n: int) -> list[int]:
        """n children of a committed row, each with its prefix."""
        return [self._new(self.rows[row]) for _ in range(n)]

    def fork_each(self, rows: Sequence[int], n: int) -> list[int]:
        """n children of each committed row, row after row."""
        return [child for row in rows for child in self.fork(row, n)]

    def adopt(self, row: int, child: int) -> None:
        """The committed row takes a candidate's row; a child holds only its parent's prefix (its step is in
        its result), so this releases the child and `commit` appends the whole step."""
        if self.rows[child] != self.rows[row]:
            raise RuntimeError(f"row {child} is not a candidate of row {row}")
        del self.rows[child]

    def release(self, rows: Sequence[int]) -> None:
        """Free rows."""
        for row in rows:
            del self.rows[row]

    def commit(self, rows: Sequence[int], steps: Sequence[Sequence[int]]) -> None:
        """Append committed steps[i] to rows[i]."""
        for row, step in zip(rows, steps):
            self.rows[row] += tuple(step)

    def tokens(self, row: int) -> list[int]:
        """The row's trajectory: its prompt and committed steps, as token ids."""
        return list(self.rows[row])

    def length(self, row: int) -> int:
        """Tokens the row holds: a full context holds all of its trajectory."""
        return len(self.rows[row])

    def rows_held(self, row: int) -> int:
        """Tokens the row holds (as `length`)."""
        return len(self.rows[row])

    def peak_length(self, row: int) -> int:
        """The largest length the row reached: its length (it only grows)."""
        return len(self.rows[row])

    # -- candidate steps ------------------------------------------------------------------------------
    def start(self, rows: Sequence[int], keys: Sequence[Sequence[int] | int], contexts: Sequence[int],
              screened: Sequence[bool], rules: StepRules) -> None:
        """Submit one request per row (forked from a committed row): seed from stream keys[i], contexts[i]
        tokens before the step. The detector runs on this engine only: no row may be screened."""
        if any(screened):
            raise ValueError("VllmRunner.start: the detector screens base candidates, which decode on this engine")
        self.engine.submit([self._request(row, rules, key, context, []) for row, key, context in zip(rows, keys, contexts)])

    def _request(self, row: int, rules: StepRules, key: Sequence[int] | int, context: int, done: list[int]) -> tuple:
        """The request that decodes row's step on from its first `done` tokens, recorded as in flight."""
        request_id = f"{row}-{next(_REQUEST_IDS)}"
        self.in_flight[request_id] = (row, rules, key, context, done)
        return request_id, [*self.rows[row], *done], self._params(rules, key, context, len(done))

    @staticmethod
    def _params(rules: StepRules, key: Sequence[int] | int, context: int, done: int = 0):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = rules.sampling
        cap = min(rules.max_step_tokens, rules.max_context - context) - done  # `done`: the step's tokens so far
        if rules.fixed_length is not None:  # synthetic steps: a fixed length, EOS and the delimiter ignored
            stop, stop_ids, cap = None, None, min(cap, rules.fixed_length)
        else:
            stop, stop_ids = [STEP_DELIMITER], sorted(rules.eos)
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=key if isinstance(key, int) else stream_key(*key), max_tokens=cap,
            # EOS is this run's EOS set (vLLM's own EOS off), special tokens kept in the text as this engine decodes
            ignore_eos=True, stop_token_ids=stop_ids, stop=stop, include_stop_str_in_output=True,
            skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @property
    def open_steps(self) -> int:
        """Candidate steps decoded by `advance` here: none, they decode in vLLM's engine process."""
        return 0

    @property
    def busy(self) -> bool:
        """Whether candidate steps are still being decoded."""
        return bool(self.in_flight)

    def prepare(self) -> None:
        """Nothing: the steps decode in vLLM's engine process."""

    def advance(self, wait: bool = False) -> list[CandidateStep]:
        """The steps that ended since the last call; with `wait`, at least one if any is open (blocks)."""
        done, again = [], []
        for output in self.engine.finished(wait and self.busy):
            row, rules, key, context, before = self.in_flight.pop(output.request_id)
            tokens = before + list(output.outputs[0].token_ids)
            self.decoded += len(tokens) - len(before)
            if self._false_stop(rules, output.outputs[0], tokens, context):
                again.append(self._request(row, rules, key, context, tokens))
                continue
            done.append(self._step(row, rules, output.outputs[0], tokens))
        if again:
            self.engine.submit(again)
        return done

    def _false_stop(self, rules: StepRules, output, tokens: list[int], context: int) -> bool:
        """Whether vLLM stopped at a `\n\n` the step's own text lacks: where the context ends inside a UTF-8
        character, its detokenizer reports text of the context's tail with a step's first tokens. The step then
        decodes on from its tokens (a new request), as this engine would, within its caps."""
        return (rules.fixed_length is None and output.stop_reason == STEP_DELIMITER
                and STEP_DELIMITER not in self.tokenizer.decode(tokens)
                and len(tokens) < min(rules.max_step_tokens, rules.max_context - context))

    def _step(self, row: int, rules: StepRules, output, tokens: list[int]) -> CandidateStep:
        if rules.fixed_length is not None:
            finish = STEP if len(tokens) == rules.fixed_length else LENGTH
        elif output.finish_reason == "stop" and tokens and tokens[-1] in rules.eos:
            finish = EOS  # before the delimiter: a false stop (`_false_stop`) can come with an EOS token
        elif output.stop_reason == STEP_DELIMITER:
            finish = STEP
        elif output.finish_reason == "length":
            finish = LENGTH
        else:
            raise RuntimeError(f"vLLM request {row}: unexpected end {output.finish_reason!r} ({output.stop_reason!r})")
        # Entropies are this engine's (vLLM reports no full-vocabulary entropy); the text is decoded as this engine does.
        return CandidateStep(row=row, tokens=tokens, text=self.tokenizer.decode(tokens), entropies=[], finish=finish)
