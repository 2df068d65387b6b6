"""The controller's policy on scripted runners (no model): commit and tie rules, adopt vs append, stop
reasons, the detector dropping candidates, progress while problems are in flight."""

from __future__ import annotations

import pytest

import kvrescue.search as search
from kvrescue.detect import DetectorConfig
from kvrescue.engine.sampling import SamplingParams
from kvrescue.engine.steps import CandidateStep
from kvrescue.methods import Method
from kvrescue.search import Controller, SearchSettings

EOS = 99


class ScriptedRunner:
    """A runner whose candidate steps come from `script(key) -> (tokens, finish)`, one token per `advance`.

    It records what the controller asks of it (prefill, start, adopt, release, commit) and keeps row lengths
    like a cache. With a `clock`, every `advance` (one token) takes one second of it. A `remote` runner stands
    for one whose steps decode in another process (vLLM): it reports no open steps here.
    """

    def __init__(self, script, clock: Clock | None = None, remote: bool = False, log: list | None = None) -> None:
        self.script = script
        self.log = [] if log is None else log  # ("prepare" | "advance", self) of every call, shared between runners
        self.clock = clock
        self.remote = remote
        self.waits: list[bool] = []  # the `wait` of every advance
        self.rows = 0
        self.length: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.prefills: list[int] = []  # how many prompts each prefill call got
        self.starts: list[tuple] = []  # (row, key, context, screened, rules) of every started candidate
        self.decoding: list[list] = []  # [row, tokens, finish, emitted]
        self.decoded = 0

    def _new(self, length: int) -> int:
        self.rows += 1
        self.length[self.rows] = length
        return self.rows

    def prefill(self, token_lists):
        self.prefills.append(len(token_lists))
        return [self._new(len(t)) for t in token_lists]

    def fork_each(self, rows, n):
        return [self._new(self.length[row]) for row in rows for _ in range(n)]

    def adopt(self, row, child):
        self.calls.append(("adopt", row, child))
        self.length[row] = self.length.pop(child)

    def release(self, rows):
        self.calls.append(("release", sorted(rows)))
        for row in rows:
            del self.length[row]

    def commit(self, rows, steps):
        self.calls.append(("commit", list(rows), [list(s) for s in steps]))

    def start(self, rows, keys, contexts, screened, rules):
        assert len(rows) == len(keys) == len(contexts) == len(screened)
        for row, key, context, screen in zip(rows, keys, contexts, screened):
            self.starts.append((row, key, context, screen, rules))
            tokens, finish = self.script(key)
            self.decoding.append([row, tokens, finish, 0])

    @property
    def open_steps(self) -> int:
        return 0 if self.remote else len(self.decoding)

    def prepare(self):
        self.log.append(("prepare", self))

    def advance(self, wait=False):
        self.log.append(("advance", self))
        self.waits.append(wait)
        self.decoded += len(self.decoding)
        if self.clock is not None:
            self.clock.now += 1.0
        done = []
        for entry in self.decoding:
            entry[3] += 1
            row, tokens, finish, emitted = entry
            if emitted == len(tokens):
                self.length[row] += len(tokens) - 1
                fired = len(tokens) if finish in ("entropy", "repetition") else None
                done.append(CandidateStep(row, tokens, " ".join(map(str, tokens)), [0.0] * len(tokens), finish,
                                          fired_at=fired))
        self.decoding = [e for e in self.decoding if e[3] < len(e[1])]
        return done

    def rows_held(self, row):
        return self.length[row]

    def peak_length(self, row):
        return self.length[row]


class TableScorer:
    """Scores a candidate by its first token (step * 10 + candidate index) from a table, 0.5 by default."""

    name = "table"

    def __init__(self, table: dict[int, float]) -> None:
        self.table, self.seen, self.committed = table, [], []
        self.calls: list[tuple] = []  # ("open", key, problem, prompt), ("commit", key, text), ("close", key)

    def open(self, key, problem, prompt):
        self.calls.append(("open", key, problem, list(prompt)))

    def score(self, requests):
        self.seen += [tokens[0] for _, _, tokens in requests]
        return [self.table.get(tokens[0], 0.5) for _, _, tokens in requests]

    def commit(self, key, text, tokens):
        self.calls.append(("commit", key, text))
        self.committed.append(tokens[0])

    def close(self, key):
        """(prefix tokens scored, truncations), made up from the key so that each problem's are its own."""
        self.calls.append(("close", key))
        return 100 + key, key


class Clock:
    """Stands in for `time` in the controller: a clock that moves only when a runner decodes a token."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def steps_of(length: int, finish: str = "step", overrides: dict[int, tuple[int, str]] | None = None):
    """A script: candidate `index` of step `step` decodes `length` tokens [step * 10 + index, ...]."""
    def script(key):
        _, _, step, index = key
        n, end = (overrides or {}).get(step * 10 + index, (length, finish))
        return [step * 10 + index] + [1] * (n - 1), end
    return script


def run_all(method: str, script, table: dict[int, float], problems, clock: Clock | None = None, **settings):
    """Run `problems` (idx, text, prompt) with n = 2 and batch = 2 (unless set); (finished, runners, scorer)."""
    spec = search.METHODS[method]
    runners = {name: ScriptedRunner(script, clock) for name, used in (("base", spec.base), ("helper", spec.helper))
               if used}
    scorer = TableScorer(table)
    finished = []
    settings = {"n": 2, "batch": 2, **settings}
    n, seed = settings.pop("n"), settings.pop("seed", 0)
    Controller(SearchSettings(**settings), runners, scorer, {EOS}, method=method, n=n, seed=seed).run(
        problems, finished.append)
    return finished, runners, scorer


def run(method: str, script, table: dict[int, float], **settings):
    finished, runners, scorer = run_all(method, script, table, [(0, "problem", [5, 6, 7])], **settings)
    return finished[0].state, runners, scorer


def test_equal_scores_commit_the_first_candidate_base_before_helper():
    # Step 0: base 0, base 1, helper 2, helper 3 all score 0.5: base 0 wins, not a later one.
    # Step 1: base 11 and helper 12 tie at the top: the base candidate wins.
    state, _, scorer = run("kvrescue", steps_of(3), {11: 0.9, 12: 0.9, 13: 0.1}, max_steps=2)
    assert [c.committed for c in state.history[0]] == [True, False, False, False]
    assert [c.committed for c in state.history[1]] == [False, True, False, False]
    assert scorer.committed == [0, 11]
    # And a strictly better later candidate does win (the tie rule is not "always the first").
    state, _, _ = run("kvrescue", steps_of(3), {3: 0.7}, max_steps=1)
    assert [c.committed for c in state.history[0]] == [False, False, False, True]


def test_base_win_adopts_in_the_base_and_appends_to_the_helper_and_the_reverse():
    state, runners, _ = run("interleave", steps_of(4), {1: 0.9, 12: 0.9, 23: 0.9}, max_steps=3)
    base, helper = runners["base"], runners["helper"]
    assert [[c.source for c in cands if c.committed] for cands in state.history] == [["base"], ["helper"], ["helper"]]
    assert [c[2] for c in base.calls if c[0] == "adopt"] == [state.history[0][1].row]
    assert [c[2] for c in helper.calls if c[0] == "adopt"] == [state.history[1][2].row, state.history[2][3].row]
    # Both models are given the whole committed step (the Runner knows what its row still lacks);
    # the last step is not appended (the problem stopped).
    for runner in (base, helper):
        assert [c[2] for c in runner.calls if c[0] == "commit"] == [[[1, 1, 1, 1]], [[12, 1, 1, 1]]]
    # The appending model's prefill counts the other model's step; the adopting one already holds it; the last
    # step (helper's, the problem stopped) is never appended to the base, so its prefill does not count it.
    assert state.prefilled == {"base": 3 + 4, "helper": 3 + 4}
    assert state.generated == {"base": 3 * 2 * 4, "helper": 3 * 2 * 4}
    assert state.stop == "steps"
    # Every candidate row but the adopted one is released each step (2 + 2 per step, minus the winner).
    released = sum(len(c[1]) for r in runners.values() for c in r.calls if c[0] == "release")
    assert released == 3 * 3 + 2  # 3 steps x 3 losers, then the 2 committed rows at retirement


def test_stop_reasons():
    state, runners, _ = run("bon", steps_of(3, overrides={10: (2, "eos"), 11: (2, "eos")}), {}, max_steps=5)
    assert state.stop == "eos" and len(state.steps) == 2
    # Step 0 is appended; the stopping step is not.
    assert [c[2] for c in runners["base"].calls if c[0] == "commit"] == [[[0, 1, 1]]]
    state, _, _ = run("bon", steps_of(4), {}, context_cap=3 + 4 * 3)
    assert state.stop == "context" and len(state.steps) == 3
    state, _, _ = run("full", steps_of(2), {}, synthetic_steps=(2, 4))
    assert state.stop == "steps" and len(state.steps) == 4


def test_the_detector_drops_base_candidates_before_scoring():
    # Base candidate 0 fired (entropy) and would score best; it is never scored nor committed.
    script = steps_of(3, overrides={0: (2, "entropy"), 1: (3, "repetition")})
    state, _, scorer = run("kvrescue", script, {0: 1.0, 1: 1.0, 3: 0.8}, max_steps=1)
    assert 0 not in scorer.seen and 1 not in scorer.seen and scorer.committed == [3]
    assert [c.score for c in state.history[0]][:2] == [None, None]
    assert [c.finish for c in state.history[0]] == ["entropy", "repetition", "step", "step"]
    # interleave does not screen: the same finish reasons are not its detector's, so nothing is dropped... but
    # a method that screens must have helper candidates, so some candidate always survives.
    with pytest.raises(ValueError):
        Method(base=True, helper=False, budgeted=True, detector=True)


def test_progress_is_reported_while_problems_are_in_flight(monkeypatch):
    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.0)
    runners = {"base": ScriptedRunner(steps_of(3))}
    seen = []
    Controller(SearchSettings(batch=2, max_steps=2), runners, TableScorer({}), {EOS}, method="bon", n=2).run(
        [(0, "p", [1])], lambda f: seen.append("finished"), seen.append)
    # One report per iteration here: 2 candidates x 1 token each, a step committed every 3 iterations.
    assert seen[:3] == [search.DecodeProgress(0, 2), search.DecodeProgress(0, 4), search.DecodeProgress(1, 6)]
    assert seen.index("finished") > 0 and seen[-1] == search.DecodeProgress(2, 12)


def test_progress_comes_every_progress_every_s_seconds(monkeypatch):
    # One second per token on the runner's clock, a report due every 2 s: after tokens 2, 4, 6 (not 3, 6).
    clock = Clock()
    monkeypatch.setattr(search, "time", clock)
    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 2.0)
    seen = []
    Controller(SearchSettings(batch=2, max_steps=2), {"base": ScriptedRunner(steps_of(3), clock)},
               TableScorer({}), {EOS}, method="bon", n=2).run([(0, "p", [1])], lambda f: None, seen.append)
    assert seen == [search.DecodeProgress(0, 4), search.DecodeProgress(1, 8), search.DecodeProgress(2, 12)]
    # Without a progress callback nothing is reported, even when a report is due at every token.
    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.0)
    finished, _, _ = run_all("bon", steps_of(3), {}, [(0, "p", [1])], max_steps=2)
    assert len(finished[0].state.steps) == 2


def test_progress_counts_the_tokens_of_both_models(monkeypatch):
    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.0)
    runners = {"base": ScriptedRunner(steps_of(3)), "helper": ScriptedRunner(steps_of(3))}
    seen = []
    Controller(SearchSettings(batch=2, max_steps=1), runners, TableScorer({}), {EOS}, method="kvrescue", n=2).run(
        [(0, "p", [1])], lambda f: None, seen.append)
    assert seen == [search.DecodeProgress(0, 4), search.DecodeProgress(0, 8), search.DecodeProgress(1, 12)]


def test_every_runner_launches_its_sampling_before_any_waits():
    """Each iteration prepares every runner (its sampling queued on the device) before it advances any (reads the
    tokens and queues the forward): the helper's sampling is not queued behind the base's forward."""
    log = []
    runners = {name: ScriptedRunner(steps_of(3), log=log) for name in ("base", "helper")}
    Controller(SearchSettings(batch=2, max_steps=1), runners, TableScorer({}), {EOS}, method="kvrescue", n=2).run(
        [(0, "p", [1])], lambda f: None)
    base, helper = runners["base"], runners["helper"]
    assert log == [("prepare", base), ("prepare", helper), ("advance", base), ("advance", helper)] * 3


def test_the_step_rules_are_the_settings():
    sampling, detector = SamplingParams(temperature=0.5, top_p=0.9, top_k=7), DetectorConfig(tau_ent=3.0, tau_cmp=0.3)
    settings = dict(n=2, sampling=sampling, detector=detector, max_step_tokens=33, context_cap=77, max_steps=1)
    for method, screens in (("kvrescue", True), ("interleave", False)):
        _, runners, _ = run(method, steps_of(3), {}, **settings)
        for runner in runners.values():
            rules = {start[4] for start in runner.starts}
            assert rules == {search.StepRules(frozenset({EOS}), sampling, 33, 77, fixed_length=None,
                                              detector=detector if screens else None)}
    # Synthetic steps: every step ends after LEN tokens (the runner's rule), problems after COUNT steps.
    state, runners, _ = run("bon", steps_of(3), {}, synthetic_steps=(3, 2), **settings)
    assert {start[4].fixed_length for start in runners["base"].starts} == {3}
    assert len(state.steps) == 2


def test_candidates_are_started_with_their_stream_key_context_and_screening():
    # Keys (seed, problem idx, step, candidate index): base candidates 0..n-1, helper candidates n..2n-1,
    # only base candidates screened, and each step starts from the committed context (prompt + steps).
    finished, runners, _ = run_all("kvrescue", steps_of(3), {}, [(4, "p", [5, 6])], seed=9, max_steps=2)
    state = finished[0].state
    assert [(key, context, screened) for _, key, context, screened, _ in runners["base"].starts] == [
        ((9, 4, 0, 0), 2, True), ((9, 4, 0, 1), 2, True), ((9, 4, 1, 0), 5, True), ((9, 4, 1, 1), 5, True)]
    assert [(key, context, screened) for _, key, context, screened, _ in runners["helper"].starts] == [
        ((9, 4, 0, 2), 2, False), ((9, 4, 0, 3), 2, False), ((9, 4, 1, 2), 5, False), ((9, 4, 1, 3), 5, False)]
    assert [[(c.source, c.index, c.row, c.screened) for c in cands] for cands in state.history] == [
        [("base", i, start[0], True) for i, start in zip((0, 1), runners["base"].starts[:2])]
        + [("helper", i, start[0], False) for i, start in zip((2, 3), runners["helper"].starts[:2])],
        [("base", i, start[0], True) for i, start in zip((0, 1), runners["base"].starts[2:])]
        + [("helper", i, start[0], False) for i, start in zip((2, 3), runners["helper"].starts[2:])]]
    # interleave samples the same candidates unscreened.
    _, runners, _ = run("interleave", steps_of(3), {}, max_steps=1)
    assert [start[3] for start in runners["base"].starts + runners["helper"].starts] == [False] * 4


def test_helper_only_numbers_its_candidates_from_zero_and_has_no_base_cache():
    finished, runners, _ = run_all("helper", steps_of(3), {1: 0.9}, [(0, "p", [5, 6])], max_steps=2)
    assert list(runners) == ["helper"]
    assert [start[1][3] for start in runners["helper"].starts] == [0, 1, 0, 1]
    assert finished[0].peak_base_rows == 0
    assert [step.base_rows for step in finished[0].state.steps] == [None, None]


def test_committed_steps_record_text_source_score_tokens_and_the_base_row_length():
    # bon: base candidate 1 wins step 0 (score 0.9), candidate 0 step 1 (a 0.5 tie, the first), 0 step 2 (eos).
    script = steps_of(3, overrides={21: (4, "step"), 20: (2, "eos")})
    finished, runners, scorer = run_all("bon", script, {1: 0.9, 20: 0.7, 21: 0.6}, [(0, "p", [5, 6, 7])])
    done = finished[0]
    assert [(s.text, s.source, s.score, s.tokens) for s in done.state.steps] == [
        ("1 1 1", "base", 0.9, 3), ("10 1 1", "base", 0.5, 3), ("20 1", "base", 0.7, 2)]
    assert done.state.stop == "eos"
    assert done.output == "1 1 110 1 120 1"  # the committed texts joined as they are
    # The scorer extends problem 0's prefix with each committed step's text.
    assert [c for c in scorer.calls if c[0] == "commit"] == [("commit", 0, "1 1 1"), ("commit", 0, "10 1 1"),
                                                            ("commit", 0, "20 1")]
    # The base row adopts the winner's fork (the scripted cache holds all but the last token of a step):
    # its length after each commit is what the step records, and its peak is the Finished's: the committed
    # lineage only (step 2's losing candidate 21 reached 3 + 2 + 2 + 3 rows; docs/outputs.md says so).
    base = runners["base"]
    row = done.state.rows["base"]
    assert [c[1] for c in base.calls if c[0] == "adopt"] == [row, row, row]
    assert [s.base_rows for s in done.state.steps] == [3 + 2, 3 + 2 + 2, 3 + 2 + 2 + 1]
    assert done.peak_base_rows == 3 + 2 + 2 + 1


def test_problems_enter_as_slots_free_up_and_each_keeps_its_own_records(monkeypatch):
    # Problem idx k stops (eos) after k + 1 steps of 2 tokens; batch 2, so problem 2 enters when problem 0 retires
    # and problem 1 is still in flight.
    clock = Clock()
    monkeypatch.setattr(search, "time", clock)

    def script(key):
        _, idx, step, index = key
        return [idx * 100 + step * 10 + index, 1], "eos" if step == idx else "step"
    problems = [(k, f"problem {k}", [5] * (k + 1)) for k in range(3)]
    finished, runners, scorer = run_all("bon", script, {}, problems, clock=clock)
    assert [f.state.idx for f in finished] == [0, 1, 2]
    assert runners["base"].prefills == [2, 1]
    assert [len(f.state.steps) for f in finished] == [1, 2, 3]
    assert [f.output for f in finished] == ["0 1", "100 1110 1", "200 1210 1220 1"]
    # Problem 2 entered after 2 s (problem 0's one step) and took 3 steps of 2 tokens.
    assert [f.wall_s for f in finished] == [2.0, 4.0, 6.0]
    assert [(f.scorer_tokens, f.scorer_truncations) for f in finished] == [(100, 0), (101, 1), (102, 2)]
    assert [c for c in scorer.calls if c[0] != "commit"] == [
        ("open", 0, "problem 0", [5]), ("open", 1, "problem 1", [5, 5]), ("close", 0),
        ("open", 2, "problem 2", [5, 5, 5]), ("close", 1), ("close", 2)]
    assert [c[1] for c in scorer.calls if c[0] == "commit"] == [0, 1, 1, 2, 2, 2]
    assert [f.state.prefilled["base"] for f in finished] == [1, 2, 3]


def test_a_runner_decoding_elsewhere_is_waited_on_only_when_nothing_decodes_here():
    # Base steps take 3 tokens here; helper steps 5 tokens in another process: for the last 2 iterations of a
    # step only the helper is pending, and both runners are told to wait.
    runners = {"base": ScriptedRunner(steps_of(3)), "helper": ScriptedRunner(steps_of(5), remote=True)}
    Controller(SearchSettings(batch=2, max_steps=2), runners, TableScorer({}), {EOS}, method="interleave", n=2).run(
        [(0, "p", [1])], lambda f: None)
    assert runners["base"].waits == runners["helper"].waits == [False, False, False, True, True] * 2


class LaunchingScorer(TableScorer):
    """A TableScorer whose scores are read later (`launch`, as the PRM's on a device); it logs when it is asked and
    when it is read, in the runners' log."""

    def __init__(self, table: dict[int, float], log: list) -> None:
        super().__init__(table)
        self.log = log

    def launch(self, requests):
        scores = self.score(requests)
        self.log.append(("launch", self))
        log = self.log

        class Pending:
            def wait(self):
                log.append(("wait", self))
                return scores
        return Pending()


def test_a_launching_scorer_is_read_after_the_other_problems_next_tokens_are_launched():
    # Problem 0's steps take 2 tokens, problem 1's 5: problem 0 is scored while problem 1 decodes.
    def script(key):
        _, idx, step, index = key
        return [step * 10 + index] + [1] * (1 if idx == 0 else 4), "step"

    problems, table = [(0, "p", [1]), (1, "q", [2])], {1: 0.9, 10: 0.9}
    log = []
    finished = []
    Controller(SearchSettings(batch=2, max_steps=2), {"base": ScriptedRunner(script, log=log)},
               LaunchingScorer(table, log), {EOS}, method="bon", n=2).run(problems, finished.append)
    events = [name for name, _ in log]
    first = events.index("launch")
    assert events[first: first + 4] == ["launch", "prepare", "advance", "wait"]
    assert events.count("launch") == events.count("wait")  # each read once
    # The same steps committed as with a scorer read at once.
    want, _, _ = run_all("bon", script, table, problems, max_steps=2)
    steps = sorted((f.state.idx, [s.text for s in f.state.steps]) for f in finished)
    assert steps == sorted((f.state.idx, [s.text for s in f.state.steps]) for f in want)
    assert dict(steps)[0] == ["1 1", "10 1"]  # the table decides
