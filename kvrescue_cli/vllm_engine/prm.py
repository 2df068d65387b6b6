"""PRM scores through vLLM's pooling runner: Qwen2ForProcessRewardModel's STEP pooling reads the head's logits at
every `<extra_0>`; a candidate's score is softmax(logits)[1] at its last one (DESIGN section 5).

The token ids are PRMScorer's (engine/prm.py `PRMInputs`): same prompt, steps, dropped steps and cut candidates.
vLLM's token classification reads no prefix cache (pooling over every token needs every token's hidden state),
so each candidate is one request holding its problem's whole prefix: the prefix is recomputed per candidate,
where PRMScorer computes it once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrescue_cli.engine.prm import WINDOW, PRMInputs, step_tag_id
from kvrescue_cli.engine.scoring import Request
from kvrescue_cli.prompts import SYSTEM_PROMPT


class VLLMPRMScorer:
    """The `prm` scorer on a vLLM engine started with runner "pooling" (`llm.start_llm`); the Scorer protocol."""

    name = "prm"

    def __init__(self, llm, tokenizer, *, window: int = WINDOW, system: str = SYSTEM_PROMPT) -> None:
        """`tokenizer`: the PRM's, as `engine.loader.load_tokenizer` reads it (the one PRMScorer's model has), so
        that both scorers feed the same token ids."""
        from vllm import PoolingParams

        self.llm = llm
        self.inputs = PRMInputs(tokenizer, step_tag_id(tokenizer, llm.model_config.model), window, system)
        # Raw head logits (no activation) at each <extra_0>: the softmax is taken here, as PRMScorer does.
        self.params = PoolingParams(use_activation=False, step_tag_id=self.inputs.sep)

    def open(self, key: int, problem: str, prompt: list[int] | None = None) -> None:
        """Start following a problem (the policy's `prompt` tokens are not needed)."""
        self.inputs.open(key, problem)

    def score(self, requests: Sequence[Request]) -> list[float]:
        """softmax(head)[1] at each candidate's <extra_0>, all candidates of all problems in one `encode` call."""
        if not requests:
            return []
        suffixes, _ = self.inputs.candidates(requests)
        ids = [self.inputs.problems[key].prefix() + s for (key, _, _), s in zip(requests, suffixes)]
        outputs = self.llm.encode([{"prompt_token_ids": row} for row in ids], self.params,
                                  pooling_task="token_classify", use_tqdm=False)
        for (key, _, _), row in zip(requests, ids):
            self.inputs.problems[key].processed += len(row)
        return [torch.softmax(out.outputs.data[-1].float(), dim=-1)[1].item() for out in outputs]

    def commit(self, key: int, text: str, tokens: list[int] | None = None) -> None:
        """The problem committed this step."""
        self.inputs.commit(key, text)

    def close(self, key: int) -> tuple[int, int]:
        """Stop following a problem; returns (tokens vLLM processed, times its input was truncated)."""
        p = self.inputs.problems.pop(key)
        return p.processed, p.truncations
