"""Skywork-o1-Open-PRM-Qwen-2.5-1.5B/7B (a Qwen2 decoder with a value head `v_head.summary`, Linear(hidden, 1)).

The reference code (SkyworkAI's skywork-o1-prm-inference, `prepare_input` and `derive_step_rewards`) builds
`tokenizer.encode(bos_token + problem + "\\n")`, then for each part of the response split at the step token "\\n":
`tokenizer.encode(part)` (nothing for an empty part) + the step token's id (`tokenizer.encode("\\n")[-1]`); the
reward of a part is sigmoid(v_head(last hidden state)) at its step token.

Here the response is the steps joined by "\\n", so a step's piece is its parts (a step holding a "\\n" has several)
each followed by the step token, and its score is read at its last step token. The pieces are the reference's own
per-part tokenisation, so they equal its input exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrescue.engine.prm_recipes.base import PRMRecipe, RecipeInputs, last_token_id, prm_step_text

STEP_TOKEN = "\n"


class SkyworkRecipe(PRMRecipe):
    def bind(self, tokenizer, model: str) -> RecipeInputs:
        if tokenizer.bos_token is None:
            raise ValueError(f"{model}: the skywork recipe starts its input with the tokenizer's BOS, and it has none")
        return SkyworkInputs(tokenizer, model)


class SkyworkInputs(RecipeInputs):
    def __init__(self, tokenizer, model: str) -> None:
        self.tokenizer = tokenizer
        self.step_token_id = last_token_id(tokenizer, STEP_TOKEN, model)

    def prompt(self, problem: str, system: str) -> list[int]:
        """BOS, the problem and "\\n" (the reference has no system prompt: `system` is unused)."""
        return self.tokenizer.encode(self.tokenizer.bos_token + problem + STEP_TOKEN)

    def candidates(self, texts: Sequence[str], index: Sequence[int]) -> list[list[int]]:
        parts = [prm_step_text(text).split(STEP_TOKEN) for text in texts]
        flat = [part for step in parts for part in step if part]
        ids = iter(self.tokenizer(flat)["input_ids"] if flat else [])
        return [[t for part in step for t in (next(ids) if part else []) + [self.step_token_id]] for step in parts]

    def score(self, head):
        return head[:, 0].sigmoid()


SKYWORK = SkyworkRecipe("skywork", "value", "Qwen2 + v_head (Skywork's PRM)",
                        "vLLM 0.32 has no value-head PRM (Skywork's v_head.summary on a Qwen2 decoder; its Qwen2 reward "
                        "models carry a two-layer score head), so the skywork recipe runs on --engine native only")
