"""PRM scores through vLLM's pooling runner: the head's outputs at every token the request computes (`ALL` token
pooling, which vLLM 0.32 lets read the prefix cache, where Qwen2ForProcessRewardModel's default `STEP` pooling does
not); a candidate's score is the recipe's, read at its last token (DESIGN section 5).

The head is the checkpoint's own for qwen-math (Qwen2ForProcessRewardModel's two classes). For the LM-head recipes
(rlhflow on Llama, math-shepherd on Mistral) vLLM's `classify` conversion turns the LM head's rows of the recipe's
"+" and "-" tokens into a 2-way classifier (`no_post_processing`: their logits as they are), which the recipe
reads as it reads those columns of the LM head's logits (`pooling_args`). vLLM 0.32 has no value-head PRM, so
Skywork's recipe is refused before any engine starts (its `no_vllm`).

The token ids are PRMScorer's (engine/prm.py `PRMInputs`): same recipe, prompt, steps, dropped steps and cut
candidates, and the same token count. Each candidate is one request holding its problem's whole prefix; vLLM's
prefix cache computes the prefix's full blocks once, as PRMScorer computes the prefix once (llm.start_llm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrescue.engine.prm import PRMInputs, seen_candidates
from kvrescue.engine.prm_recipes import FORMATS, PRMRecipe
from kvrescue.engine.scoring import Request
from kvrescue.prompts import SYSTEM_PROMPT
from kvrescue.scorers import PRM
from kvrescue.shapes import PRM_WINDOW


def pooling_args(recipe: PRMRecipe, tokenizer, model: str) -> dict[str, Any]:
    """The engine arguments (`start_llm`'s) under which vLLM's pooling runner outputs the head `recipe` reads:
    none for the checkpoint's own PRM head; for an LM-head recipe, the `classify` conversion to a classifier of the
    LM head's rows of its `columns` tokens, in order (vLLM finds each row by its token's id). A ValueError where
    the tokenizer cannot take the recipe."""
    if recipe.head != "lm":
        return {}
    from vllm.config import PoolerConfig

    tokens = tokenizer.convert_ids_to_tokens(recipe.bind(tokenizer, model).columns)
    return dict(convert="classify", pooler_config=PoolerConfig(task="token_classify", tok_pooling_type="ALL"),
                hf_overrides={"method": "no_post_processing", "classifier_from_token": tokens})


class VLLMPRMScorer:
    """The `prm` scorer on a vLLM engine started with runner "pooling" (`llm.start_llm`); the Scorer protocol."""

    name = PRM

    def __init__(self, llm, tokenizer, *, window: int = PRM_WINDOW, system: str = SYSTEM_PROMPT,
                 recipe: PRMRecipe = FORMATS["paper"]) -> None:
        """`tokenizer`: the PRM's, as `engine.loader.load_tokenizer` reads it (the one PRMScorer's model has), so
        that both scorers feed the same token ids."""
        from vllm import PoolingParams

        self.llm = llm
        self.inputs = PRMInputs(tokenizer, recipe, window, system, llm.model_config.model)
        # Raw head logits (no activation): the softmax is taken here, as PRMScorer does. Token pooling skips the prefix
        # cache unless told (its output would miss the cached tokens): here only the last token is read.
        self.params = PoolingParams(use_activation=False, skip_reading_prefix_cache=False)

    def open(self, key: int, problem: str, prompt: list[int] | None = None) -> None:
        """Start following a problem (the policy's `prompt` tokens are not needed)."""
        self.inputs.open(key, problem)

    def score(self, requests: Sequence[Request]) -> list[float | None]:
        """The recipe's score at each candidate's last token, all candidates of all problems in one `encode` call
        (the served head's outputs are the recipe's columns: `pooling_args`); None where the PRM sees no token
        (`engine.prm.seen_candidates`)."""
        if not requests:
            return []
        suffixes = self.inputs.candidates(requests)
        self.inputs.take_unfed()  # the prefixes' new tokens, computed by the first request that holds them
        seen = seen_candidates(suffixes)
        scores: list[float | None] = [None] * len(suffixes)
        if not seen:
            return scores
        ids = [self.inputs.problems[requests[i][0]].prefix() + suffixes[i] for i in seen]
        outputs = self.llm.encode([{"prompt_token_ids": row} for row in ids], self.params,
                                  pooling_task="token_classify", use_tqdm=False)
        heads = self.inputs.codec.score(torch.stack([out.outputs.data[-1].float() for out in outputs])).tolist()
        for i, score in zip(seen, heads):
            scores[i] = score
        return scores

    def commit(self, key: int, text: str, tokens: list[int] | None = None) -> None:
        """The problem committed this step."""
        self.inputs.commit(key, text)

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens the PRM processed, counted as PRMScorer counts them, and
        times its input was cut to the window)."""
        return self.inputs.close(key)
