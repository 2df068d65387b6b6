"""Candidate steps decoded by vLLM (`VllmRunner`): valid steps, seeded streams, and the controller committing
exactly what vLLM generated to the base on this engine. Runs where vLLM is installed (`pytest -m vllm`)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("vllm")

from kvrescue.engine import FullCache, load_model  # noqa: E402
from kvrescue.engine.prm import PRMScorer  # noqa: E402
from kvrescue.engine.prm_recipes import FORMATS  # noqa: E402
from kvrescue.engine.runner import Runner  # noqa: E402
from kvrescue.engine.steps import StepRules  # noqa: E402
from kvrescue.prompts import STEP_DELIMITER, generation_prompt  # noqa: E402
from kvrescue.search import Controller, SearchSettings  # noqa: E402
from kvrescue.vllm_engine.llm import start_llm  # noqa: E402
from kvrescue.vllm_engine.steps import SteppedEngine, VllmRunner  # noqa: E402
from tests.oracles import generate_steps  # noqa: E402

pytestmark = pytest.mark.vllm
PROBLEMS = ["What is 3x + 5 = 20?", "Find the sum 1 + 2 + 3 + ... + 10.", "The square root of 144 is"]


class RecordingEngine(SteppedEngine):
    """The stepped engine, keeping every request's prompt and the token ids vLLM returned for it."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.prompts: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {}

    def submit(self, requests):
        for request_id, prompt, _ in requests:
            self.prompts[int(request_id.split("-")[0])] = list(prompt)
        super().submit(requests)

    def finished(self, wait):
        done = super().finished(wait)
        for output in done:
            self.outputs[int(output.request_id.split("-")[0])] = list(output.outputs[0].token_ids)
        return done


@pytest.fixture(scope="module")
def model(step_qwen2_dir):
    return load_model(step_qwen2_dir)


@pytest.fixture(scope="module")
def engine(step_qwen2_dir):
    """One vLLM engine for the module (each start costs ~20-30 s on idle cores)."""
    llm = start_llm(step_qwen2_dir, dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20,
                    enable_prefix_caching=True, enforce_eager=True)
    stepped = RecordingEngine(llm.llm_engine)
    yield stepped
    stepped.close()


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(generation_prompt(tokenizer, p), add_special_tokens=False) for p in PROBLEMS]


def check_step(tokenizer, eos: set[int], tokens: list[int], text: str, finish: str, cap: int) -> None:
    """A step ends at its first delimiter (in decoded text), EOS, or its cap, and its text decodes its tokens."""
    assert tokens and text == tokenizer.decode(tokens)
    assert not eos & set(tokens[:-1]) and STEP_DELIMITER not in tokenizer.decode(tokens[:-1])
    if finish == "eos":
        assert tokens[-1] in eos
    elif finish == "step":
        assert STEP_DELIMITER in text and tokens[-1] not in eos
    else:
        assert finish == "length" and len(tokens) == cap and STEP_DELIMITER not in text and tokens[-1] not in eos


def test_candidate_steps_end_by_the_rules_and_decode_to_their_text(engine, model):
    tokenizer, eos = model.tokenizer, set(model.eos_ids)
    runner = VllmRunner(engine, tokenizer)
    rules = StepRules(frozenset(eos), max_step_tokens=40, max_context=1024)
    rows = [child for row in runner.prefill(prompts(tokenizer)) for child in runner.fork(row, 6)]
    keys = [(0, i // 6, 0, i % 6) for i in range(len(rows))]
    steps = generate_steps(runner, rows, keys, rules)
    for step in steps:
        check_step(tokenizer, eos, step.tokens, step.text, step.finish, 40)
        assert engine.outputs[step.row] == step.tokens
    assert set(Counter(s.finish for s in steps)) == {"step", "eos", "length"}
    assert runner.decoded == sum(len(s.tokens) for s in steps) and not runner.busy
    # The context cap: a row 5 tokens short of it ends there.
    near = runner.prefill([(prompts(tokenizer)[0] * 100)[:1019]])[0]
    (capped,) = generate_steps(runner, [near], [(0, 9, 0, 0)], rules)
    assert len(capped.tokens) <= 5 and (capped.finish != "length" or len(capped.tokens) == 5)
    # Seeded by the candidate's key: the same keys draw the same steps, other keys others.
    again = generate_steps(runner, [runner.fork(row, 1)[0] for row in rows], keys, rules)
    assert [s.tokens for s in again] == [s.tokens for s in steps]
    other = generate_steps(runner, [runner.fork(row, 1)[0] for row in rows], [(1, *k[1:]) for k in keys], rules)
    assert [s.tokens for s in other] != [s.tokens for s in steps]


class CheckedBase(Runner):
    """The base on this engine, checking after every commit that its row holds exactly the committed tokens:
    its next-token logits equal a fresh forward over prompt + committed steps."""

    def __init__(self, model, cache) -> None:
        super().__init__(model, cache)
        self.tokens: dict[int, list[int]] = {}

    def prefill(self, token_lists):
        rows = super().prefill(token_lists)
        self.tokens.update((row, list(tokens)) for row, tokens in zip(rows, token_lists))
        return rows

    def commit(self, rows, steps):
        super().commit(rows, steps)
        for row, step in zip(rows, steps):
            self.tokens[row] += step
            fresh = self.model.logits(torch.tensor([self.tokens[row]]))[0, -1]
            torch.testing.assert_close(self.logits[row], fresh, rtol=1e-4, atol=1e-4)


def test_the_trajectory_committed_to_the_base_is_what_vllm_generated(engine, model, prm_dir):
    tokenizer = model.tokenizer
    base = CheckedBase(model, FullCache.for_model(model.net, 16384, max_rows=32))
    helper = VllmRunner(engine, tokenizer)
    # Short steps: most end at the cap, so that problems go on for several steps (EOS ends a problem).
    settings = SearchSettings(batch=2, max_step_tokens=6, max_steps=5, context_cap=1024)
    # (the model card's recipe: with it these random models' problems run to three steps and more)
    scorer = PRMScorer(load_model(prm_dir), max_problems=2, max_candidates=8, max_step_tokens=6,
                       recipe=FORMATS["model-card"])
    finished, held = [], {}

    def done(f):  # the base row as the problem retires (its id may be reused by the next problem)
        finished.append(f)
        held[f.state.idx] = base.tokens[f.state.rows["base"]]

    Controller(settings, {"base": base, "helper": helper}, scorer, set(model.eos_ids), method="kvrescue", n=2).run(
        [(i, text, prompt) for i, (text, prompt) in enumerate(zip(PROBLEMS, prompts(tokenizer)))], done)
    assert sorted(f.state.idx for f in finished) == [0, 1, 2]
    helper_wins = 0
    for f in finished:
        state = f.state
        trajectory = list(state.prompt)
        for candidates in state.history:
            winner = next(c for c in candidates if c.committed)
            for cand in (c for c in candidates if c.source == "helper"):
                assert engine.prompts[cand.row] == trajectory  # every helper request starts from the exact prefix
                assert engine.outputs[cand.row] == cand.tokens  # and its candidate is what vLLM returned
                check_step(tokenizer, set(model.eos_ids), cand.tokens, cand.text, cand.finish, 6)
            helper_wins += winner.source == "helper"
            trajectory += winner.tokens
        assert trajectory == state.prompt + state.committed
        # The base row held the trajectory (checked against a fresh forward at every commit) up to the last
        # step, which ended the problem and was not fed to it.
        assert held[state.idx] == trajectory[: len(trajectory) - len(winner.tokens)]
    assert helper_wins > 0  # vLLM's tokens were committed to the base
    assert sum(len(f.state.history) >= 3 for f in finished) >= 2  # and later steps started from them
    assert {c.source for f in finished for cands in f.state.history for c in cands} == {"base", "helper"}


def test_the_helper_method_runs_on_vllm_alone(engine, model, prm_dir):
    """Only vLLM decodes: the controller waits on it instead of polling."""
    tokenizer = model.tokenizer
    helper = VllmRunner(engine, tokenizer)
    settings = SearchSettings(batch=2, max_step_tokens=24, max_steps=4, context_cap=1024)
    scorer = PRMScorer(load_model(prm_dir), max_problems=2, max_candidates=8, max_step_tokens=24)
    finished = []
    Controller(settings, {"helper": helper}, scorer, set(model.eos_ids), method="helper", n=3).run(
        [(i, text, prompt) for i, (text, prompt) in enumerate(zip(PROBLEMS, prompts(tokenizer)))], finished.append)
    assert sorted(f.state.idx for f in finished) == [0, 1, 2]
    for f in finished:
        assert 1 <= len(f.state.steps) <= 4 and all(len(c) == 3 for c in f.state.history)
        assert f.output == "".join(s.text for s in f.state.steps)
    assert helper.rows == {} and not helper.busy


def test_synthetic_steps_end_at_their_length_alone(engine, model, prm_dir):
    """`--synthetic-steps LEN:COUNT` on vLLM: every candidate is LEN tokens (EOS and the delimiter do not end it;
    the context cap still does), and every problem ends after COUNT steps."""
    tokenizer, eos = model.tokenizer, set(model.eos_ids)
    runner = VllmRunner(engine, tokenizer)
    rules = StepRules(frozenset(eos), max_step_tokens=40, max_context=1024, fixed_length=16)
    rows = [child for row in runner.prefill(prompts(tokenizer)) for child in runner.fork(row, 6)]
    steps = generate_steps(runner, rows, [(0, i // 6, 0, i % 6) for i in range(len(rows))], rules)
    assert all(len(s.tokens) == 16 and s.finish == "step" and s.text == tokenizer.decode(s.tokens) for s in steps)
    # Steps that would have ended earlier by the usual rules went on.
    assert any(eos & set(s.tokens[:-1]) or STEP_DELIMITER in tokenizer.decode(s.tokens[:-1]) for s in steps)
    near = runner.prefill([(prompts(tokenizer)[0] * 100)[:1019]])[0]
    (capped,) = generate_steps(runner, [near], [(0, 9, 0, 0)], rules)
    assert len(capped.tokens) == 5 and capped.finish == "length"
    # Through the controller: the helper method on vLLM, 3 steps of 5 tokens per problem.
    settings = SearchSettings(batch=2, max_step_tokens=24, synthetic_steps=(5, 3),
                              context_cap=1024)
    scorer = PRMScorer(load_model(prm_dir), max_problems=2, max_candidates=8, max_step_tokens=24)
    finished = []
    Controller(settings, {"helper": runner}, scorer, eos, method="helper", n=2).run(
        [(i, text, prompt) for i, (text, prompt) in enumerate(zip(PROBLEMS, prompts(tokenizer)))], finished.append)
    assert sorted(f.state.idx for f in finished) == [0, 1, 2]
    for f in finished:
        assert f.state.stop == "steps" and [s.tokens for s in f.state.steps] == [5, 5, 5]
        assert all(len(c.tokens) == 5 and c.finish == "step" for cands in f.state.history for c in cands)
