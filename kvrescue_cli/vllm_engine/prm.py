"""PRM scores through vLLM's pooling runner: Qwen2ForProcessRewardModel's head logits at every token the request
computes (`ALL` token pooling, which vLLM 0.32 lets read the prefix cache, where the PRM's default `STEP` pooling
does not); a candidate's score is softmax(logits)[1] at its last token, in both formats of the qwen-math recipe
(DESIGN section 5), the only recipe vLLM 0.32 serves (engine/prm_recipes/choose.py refuses the others).

The token ids are PRMScorer's (engine/prm.py `PRMInputs`): same recipe, prompt, steps, dropped steps and cut
candidates, and the same token count. Each candidate is one request holding its problem's whole prefix; vLLM's
prefix cache computes the prefix's full blocks once, as PRMScorer computes the prefix once (llm.start_llm).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrescue_cli.engine.prm import PRMInputs
from kvrescue_cli.engine.prm_recipes import FORMATS, PRMRecipe
from kvrescue_cli.engine.scoring import Request
from kvrescue_cli.prompts import SYSTEM_PROMPT
from kvrescue_cli.scorers import PRM
from kvrescue_cli.shapes import PRM_WINDOW


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

    def score(self, requests: Sequence[Request]) -> list[float]:
        """The recipe's score (softmax(head)[1]) at each candidate's last token, all candidates of all problems in one
        `encode` call."""
        if not requests:
            return []
        suffixes = self.inputs.candidates(requests)
        self.inputs.take_unfed()  # the prefixes' new tokens, computed by the first request that holds them
        ids = [self.inputs.problems[key].prefix() + s for (key, _, _), s in zip(requests, suffixes)]
        outputs = self.llm.encode([{"prompt_token_ids": row} for row in ids], self.params,
                                  pooling_task="token_classify", use_tqdm=False)
        return self.inputs.codec.score(torch.stack([out.outputs.data[-1].float() for out in outputs])).tolist()

    def commit(self, key: int, text: str, tokens: list[int] | None = None) -> None:
        """The problem committed this step."""
        self.inputs.commit(key, text)

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens the PRM processed, counted as PRMScorer counts them, and
        times its input was cut to the window)."""
        return self.inputs.close(key)
