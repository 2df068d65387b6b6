"""peiyi9979/math-shepherd-mistral-7b-prm (MistralForCausalLM: the LM head reads the score).

The model card's input is `tokenizer.encode(question + " " + output)`, where the output's steps each end in the
step tag " ки" and are joined by "\\n"; a step's score is softmax over the logits of the candidate ids
`tokenizer.encode("+ -")[1:]` ("+" good, "-" bad; [648, 387] on the real tokenizer), index 0, at the step tag's
token (`tokenizer.encode("ки")[-1]`).

"Step k:" prefixes: the card's example steps begin with "Step k: "; search-and-learn's scorer adds none to the
policy's steps, and this recipe follows it: each step is the policy's text as generated (the paper's prompt asks
for none; a policy that writes them keeps them).

Pieces: the prompt is `encode(question)` (with the tokenizer's BOS, as the card's `encode` adds it); a step's piece
is " " + step + " ки" for the first step, "\\n" + step + " ки" after, ending at the tag, where its score is read.
A piece is tokenised after the tag (`encode_after`), as it follows one in the whole text: a SentencePiece-style
tokenizer would mark a word start at the beginning of a text tokenised on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrescue.engine.prm_recipes.base import (
    LabelInputs, PRMRecipe, RecipeInputs, encode_after, last_token_id, prm_step_text,
)

STEP_TAG = "ки"


class MathShepherdRecipe(PRMRecipe):
    def bind(self, tokenizer, model: str) -> RecipeInputs:
        return MathShepherdInputs(tokenizer, model)


class MathShepherdInputs(LabelInputs):
    def __init__(self, tokenizer, model: str) -> None:
        self.tokenizer, self.model = tokenizer, model
        self.columns = tokenizer.encode("+ -")[1:]
        self.tag = last_token_id(tokenizer, STEP_TAG, model)
        if len(self.columns) != 2:
            raise ValueError(f"{model}: the math-shepherd recipe reads the ids of '+' and '-' as the card takes them "
                             f"(encode('+ -')[1:]), and its tokenizer makes {len(self.columns)} ids of them")
        if self.candidates(["x"], [1])[0][-1:] != [self.tag]:
            raise ValueError(f"{model}: its tokenizer makes no {STEP_TAG!r} token at the end of a step")

    def prompt(self, problem: str, system: str) -> list[int]:
        """The question with the tokenizer's BOS (the card has no system prompt: `system` is unused)."""
        return self.tokenizer.encode(problem)

    def candidates(self, texts: Sequence[str], index: Sequence[int]) -> list[list[int]]:
        pieces = [(" " if i == 0 else "\n") + prm_step_text(text) + " " + STEP_TAG for text, i in zip(texts, index)]
        return encode_after(self.tokenizer, STEP_TAG, pieces, self.model)


MATH_SHEPHERD = MathShepherdRecipe("math-shepherd", "lm", "MistralForCausalLM", no_vllm=None)
