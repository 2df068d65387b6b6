"""PRM scores from vLLM's pooling runner equal PRMScorer's (fp32, random PRMs), driven through the same scorer
protocol in both qwen-math formats and the LM-head recipes (rlhflow, math-shepherd): several problems, multi-step
trajectories, several candidates a step, and a window that drops steps; the same token ids, the same token count,
and the committed prefix read from vLLM's prefix cache."""

import pytest

from kvrescue.engine import load_model
from kvrescue.engine.loader import load_tokenizer
from kvrescue.engine.prm import PRMScorer
from kvrescue.engine.prm_recipes import FORMATS, get_recipe
from kvrescue.shapes import PRM_WINDOW
from kvrescue.vllm_engine.prm import VLLMPRMScorer
from kvrescue.vllm_engine.roles import EngineSpec, VllmEngines
from tests.engine.test_prm import PROBLEMS, STEPS, recipe_ids

pytestmark = pytest.mark.vllm

MORE_PROBLEMS = PROBLEMS + ["Find the square root of 144."]
MORE_STEPS = STEPS + [["The square root of 144 is 12, since 12 * 12 = 144.\n\n", "So the answer is \\boxed{12}."]]
DISTRACTORS = ["A wrong turn: x = 7.\n\n", "\n\nWe start over", "Check: 3 * 5 + 5 = 15 + 5 = 20.<|im_end|>"]


class Recording:
    """A vLLM engine that keeps the token ids of every request sent to `encode`, and its outputs."""

    def __init__(self, llm) -> None:
        self.llm, self.sent, self.outputs = llm, [], []

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def encode(self, prompts, *args, **kwargs):
        self.sent += [p["prompt_token_ids"] for p in prompts]
        outputs = self.llm.encode(prompts, *args, **kwargs)
        self.outputs += outputs
        return outputs


def drive(scorer, problems: list[str], steps: list[list[str]], processed: list[int] | None = None
          ) -> tuple[list[float], list[tuple[int, int]]]:
    """Every problem's candidates (its true step and the distractors) scored in one call per step, then the
    true step committed; returns every score and each problem's (dropped steps, truncations), and appends each
    problem's processed tokens to `processed`."""
    scores = []
    for key, problem in enumerate(problems):
        scorer.open(key, problem, [])
    for t in range(max(map(len, steps))):
        live = [k for k in range(len(problems)) if t < len(steps[k])]
        scores += scorer.score([(k, text, []) for k in live for text in [steps[k][t], *DISTRACTORS]])
        for k in live:
            scorer.commit(k, steps[k][t], [])
    dropped = [scorer.inputs.problems[k].kept_from for k in range(len(problems))]
    closed = [scorer.close(k) for k in range(len(problems))]
    if processed is not None:
        processed += [tokens for tokens, _ in closed]
    return scores, [(d, truncations) for d, (_, truncations) in zip(dropped, closed)]


@pytest.fixture(scope="module")
def prm(vllm_prm_dir):
    return load_model(vllm_prm_dir)


@pytest.mark.parametrize("recipe", ["paper", "model-card"])
def test_vllm_scores_and_token_counts_equal_prm_scorer(prm, vllm_prm, vllm_prm_dir, recipe) -> None:
    want_tokens, got_tokens = [], []
    want, _ = drive(PRMScorer(prm, max_problems=4, max_candidates=16, recipe=FORMATS[recipe]), MORE_PROBLEMS,
                    MORE_STEPS, want_tokens)
    tokenizer, _ = load_tokenizer(vllm_prm_dir)  # read as `--engine vllm` reads it, apart from PRMScorer's model
    got, truncated = drive(VLLMPRMScorer(vllm_prm, tokenizer, recipe=FORMATS[recipe]), MORE_PROBLEMS, MORE_STEPS,
                           got_tokens)
    assert len(got) == len(want) == 4 * (3 + 3 + 2)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert len({round(s, 4) for s in want}) > len(want) // 2  # the candidates are told apart
    assert truncated == [(0, 0)] * 3
    assert got_tokens == want_tokens  # a committed prefix counted once on both engines, and every candidate


@pytest.mark.parametrize("recipe", ["paper", "model-card"])
def test_vllm_is_sent_exactly_the_recipe_s_ids_and_reads_the_prefix_from_its_cache(vllm_prm, vllm_prm_dir,
                                                                                    recipe) -> None:
    tokenizer, _ = load_tokenizer(vllm_prm_dir)
    llm = Recording(vllm_prm)
    scorer = VLLMPRMScorer(llm, tokenizer, recipe=FORMATS[recipe])
    problem = PROBLEMS[0] + " " + " ".join(f"Then {i} + {i} = {2 * i}." for i in range(40))  # over a 128-token block
    scorer.open(0, problem, [])
    for t, step in enumerate(STEPS[0]):
        candidates = [step, *DISTRACTORS]
        scorer.score([(0, text, []) for text in candidates])
        for sent, text in zip(llm.sent[-len(candidates):], candidates):
            assert sent == recipe_ids(tokenizer, recipe, problem, STEPS[0][:t] + [text])[0]
        scorer.commit(0, step, [])
    block = vllm_prm.llm_engine.vllm_config.cache_config.block_size
    assert len(scorer.inputs.problems[0].prompt) >= block
    assert all(out.num_cached_tokens >= block for out in llm.outputs[1:])  # the prefix computed once
    scorer.close(0)


def test_the_window_drops_the_same_steps(prm, vllm_prm) -> None:
    long = [STEPS[0] * 3, STEPS[1] * 3]
    want, want_dropped = drive(PRMScorer(prm, max_problems=2, max_candidates=8, window=120), PROBLEMS, long)
    got, dropped = drive(VLLMPRMScorer(vllm_prm, prm.tokenizer, window=120), PROBLEMS, long)
    assert dropped == want_dropped and all(d > 0 and n > 0 for d, n in dropped)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize("name, folder", [("rlhflow", "vllm_rlhflow_dir"), ("math-shepherd", "vllm_math_shepherd_dir")])
def test_an_lm_head_recipe_on_vllm_scores_as_prm_scorer(name, folder, request) -> None:
    """An LM-head PRM's engine as `--engine vllm` starts it (VllmEngines: the LM head's "+" and "-" rows as vLLM's
    classifier) scores a random Llama 3.1-like (rlhflow) or Mistral (math-shepherd) checkpoint as PRMScorer does,
    counts the same tokens, and reads a long problem's committed prefix from its prefix cache."""
    folder = request.getfixturevalue(folder)
    recipe = get_recipe(name)
    problems = MORE_PROBLEMS[:-1] + [PROBLEMS[0] + " " + " ".join(f"Then {i} + {i} = {2 * i}." for i in range(40))]
    want_tokens, got_tokens = [], []
    want, _ = drive(PRMScorer(load_model(folder), max_problems=4, max_candidates=16, recipe=recipe), problems,
                    MORE_STEPS, want_tokens)
    engines = VllmEngines([EngineSpec(str(folder), ("prm",), PRM_WINDOW)], "float32", recipe,
                          [dict(kv_cache_bytes=64 << 20, enforce_eager=True)])
    try:
        scorer = engines.scorer()
        llm = scorer.llm = Recording(engines.prm)
        got, truncated = drive(scorer, problems, MORE_STEPS, got_tokens)
    finally:
        engines.close()
    assert len(got) == len(want) == 4 * (3 + 3 + 2)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert len({round(s, 4) for s in want}) > len(want) // 2  # the candidates are told apart
    assert truncated == [(0, 0)] * 3 and got_tokens == want_tokens
    block = engines.prm.llm_engine.vllm_config.cache_config.block_size
    assert max(out.num_cached_tokens for out in llm.outputs) >= block


def test_deterministic_engines_start_in_vllms_batch_invariant_mode(monkeypatch):
    """`--deterministic` with `--engine vllm` (a GPU's: grid.py refuses a CPU's) sets VLLM_BATCH_INVARIANT before
    any engine starts, which vLLM's envs.py reads in this process and its engine cores inherit (on a CPU their
    workers then fail: the variable must not outlive the test)."""
    import vllm.envs

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # unset again after the test, before any later engine starts
    VllmEngines([], "float32", get_recipe("qwen-math"), [])
    assert not vllm.envs.VLLM_BATCH_INVARIANT
    VllmEngines([], "float32", get_recipe("qwen-math"), [], batch_invariant=True)
    assert vllm.envs.VLLM_BATCH_INVARIANT
