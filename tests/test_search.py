"""The controller's policy on scripted runners (no model): commit and tie rules, adopt vs append, stop
reasons, the detector dropping candidates, progress while problems are in flight."""

from __future__ import annotations

import pytest

import kvrescue_cli.search as search
from kvrescue_cli.engine.steps import CandidateStep
from kvrescue_cli.search import Controller, SearchSettings

EOS = 99


class ScriptedRunner:
    """A runner whose candidate steps come from `script(key) -> (tokens, finish)`, one token per `advance`.

    It records what the controller asks of it (adopt, release, commit) and keeps row lengths like a cache.
    """

    def __init__(self, script) -> None:
        self.script = script
        self.rows = 0
        self.length: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.decoding: list[list] = []  # [row, tokens, finish, emitted]

    def _new(self, length: int) -> int:
        self.rows += 1
        self.length[self.rows] = length
        return self.rows

    def prefill(self, token_lists):
        return [self._new(len(t)) for t in token_lists]

    def fork(self, row, n):
        return [self._new(self.length[row]) for _ in range(n)]

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
        for row, key in zip(rows, keys):
            tokens, finish = self.script(key)
            self.decoding.append([row, tokens, finish, 0])

    @property
    def open_steps(self) -> int:
        return len(self.decoding)

    def advance(self):
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

    def open(self, key, problem, prompt):
        pass

    def score(self, requests):
        self.seen += [tokens[0] for _, _, tokens in requests]
        return [self.table.get(tokens[0], 0.5) for _, _, tokens in requests]

    def commit(self, key, text, tokens):
        self.committed.append(tokens[0])

    def close(self, key):
        return 0, 0


def steps_of(length: int, finish: str = "step", overrides: dict[int, tuple[int, str]] | None = None):
    """A script: candidate `index` of step `step` decodes `length` tokens [step * 10 + index, ...]."""
    def script(key):
        _, _, step, index = key
        n, end = (overrides or {}).get(step * 10 + index, (length, finish))
        return [step * 10 + index] + [1] * (n - 1), end
    return script


def run(method: str, script, table: dict[int, float], **settings):
    spec = search.METHODS[method]
    runners = {name: ScriptedRunner(script) for name, used in (("base", spec.base), ("helper", spec.helper)) if used}
    scorer = TableScorer(table)
    finished = []
    Controller(SearchSettings(method=method, n=2, batch=2, **settings), runners, scorer, {EOS}).run(
        [(0, "problem", [5, 6, 7])], finished.append)
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
    # The appending model's prefill counts the other model's step; the adopting one already holds it.
    assert state.prefilled == {"base": 3 + 4 + 4, "helper": 3 + 4}
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
        search.Method(base=True, helper=False, evicted=True, detector=True)


def test_progress_is_reported_while_problems_are_in_flight(monkeypatch):
    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.0)
    runners = {"base": ScriptedRunner(steps_of(3))}
    seen = []
    Controller(SearchSettings(method="bon", n=2, batch=2, max_steps=2), runners, TableScorer({}), {EOS}).run(
        [(0, "p", [1])], lambda f: seen.append("finished"), seen.append)
    # One report per iteration here: 2 candidates x 1 token each, a step committed every 3 iterations.
    assert seen[:3] == [search.DecodeProgress(0, 2), search.DecodeProgress(0, 4), search.DecodeProgress(1, 6)]
    assert seen.index("finished") > 0 and seen[-1] == search.DecodeProgress(2, 12)
