"""Qwen2.5-Math-PRM-7B/72B (Qwen2ForProcessRewardModel, a 2-class head): its two input formats, `--prm-format`
(DESIGN section 5; the README's "PRM recipes" gives the reading and its reasons).

A format turns a trajectory into text: a prompt, then one piece per step. A step's score is softmax(head)[1] at
the last token of the text that ends with that step, in both recipes:
- `paper` (the paper's appendix): prompt ⊕ "\\n\\n" ⊕ s1 ⊕ "\\n\\n" ⊕ ... ⊕ sk ⊕ "\\n\\n", where the prompt is the
  chat text the policy continues (system prompt, user = problem, the assistant turn opened) and each step is
  joined by one "\\n\\n" (its own delimiter is taken off first, so none is doubled). The final token is whatever
  the tokenizer makes of the text's end: Qwen's merges the separator with the step's last characters
  (".\\n\\n" is one token), and the score is read there.
- `model-card` (Qwen2.5-Math-PRM-7B's card): the chat text with assistant content
  "<extra_0>".join(steps) + "<extra_0>"; the last token is the step's `<extra_0>`.

The scorers tokenise the prompt and each step's piece on their own and concatenate the ids, so that a committed
prefix is encoded and cached once. That equals tokenising the whole text: special tokens split it before BPE
(`model-card`), and Qwen's pre-tokenizer ends a run of newlines before a letter, digit, space or symbol (`paper`),
unless a step begins with a newline (then the whole text would merge it with the separator before it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrescue.chat_templates import render_chat
from kvrescue.engine.prm_recipes.base import PRMRecipe, RecipeInputs, prm_step_text
from kvrescue.engine.texts import encoder
from kvrescue.prompts import STEP_DELIMITER, chatml

STEP_TAG = "<extra_0>"
def chat_prefix(tokenizer, problem: str, system: str) -> str:
    """The chat text up to where the assistant's content starts (the PRM's own template, else ChatML)."""
    hole = "\x00kvrescue-assistant\x00"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": problem},
                {"role": "assistant", "content": hole}]
    if getattr(tokenizer, "chat_template", None):
        rendered = render_chat(tokenizer, messages)
    else:
        rendered = chatml(messages, open_assistant=False)
    return rendered[: rendered.index(hole)]


def step_tag_id(tokenizer, name: str) -> int:
    """The id of `<extra_0>`, where the model card reads each step's score; a ValueError when the tokenizer has
    none."""
    sep = tokenizer.convert_tokens_to_ids(STEP_TAG)
    if sep is None or sep == tokenizer.unk_token_id:
        raise ValueError(f"{name}: tokenizer has no {STEP_TAG} token")
    return sep


@dataclass(frozen=True)
class QwenMathRecipe(PRMRecipe):
    """How a trajectory becomes the PRM's input text: the prompt, then each step's piece (`step`); the score is
    softmax(head)[1] there."""

    format: str  # --prm-format
    after_prompt: str  # what follows the chat prefix before the first step
    after_step: str  # what follows every step's text

    def prompt(self, tokenizer, problem: str, system: str) -> str:
        """The text before the first step."""
        return chat_prefix(tokenizer, problem, system) + self.after_prompt

    def step(self, text: str) -> str:
        """One generated step's piece; its last token is where its score is read."""
        return prm_step_text(text) + self.after_step

    def text(self, tokenizer, problem: str, steps: list[str], system: str) -> str:
        """The whole input of a trajectory, as one string."""
        return self.prompt(tokenizer, problem, system) + "".join(self.step(s) for s in steps)

    def check(self, tokenizer, name: str) -> None:
        """A ValueError when the PRM's tokenizer cannot take this recipe (the model card's needs `<extra_0>`)."""
        if STEP_TAG in self.after_step:
            step_tag_id(tokenizer, name)

    def bind(self, tokenizer, model: str) -> RecipeInputs:
        self.check(tokenizer, model)
        return QwenMathInputs(self, tokenizer)


class QwenMathInputs(RecipeInputs):
    """A format's text pieces, each tokenised on its own (the ids they have always had)."""

    def __init__(self, recipe: QwenMathRecipe, tokenizer) -> None:
        self.recipe, self.tokenizer, self.encode = recipe, tokenizer, encoder(tokenizer)

    def prompt(self, problem: str, system: str) -> list[int]:
        return self.encode([self.recipe.prompt(self.tokenizer, problem, system)])[0]

    def candidates(self, texts: Sequence[str], index: Sequence[int]) -> list[list[int]]:
        return self.encode([self.recipe.step(text) for text in texts])

    def score(self, head):
        return head.softmax(-1)[:, 1]


QWEN_MATH = "Qwen2ForProcessRewardModel"
FORMATS = {  # --prm-format: what follows the chat prefix, and each step
    name: QwenMathRecipe("qwen-math", "classes", QWEN_MATH, no_vllm=None, format=name, after_prompt=prompt,
                         after_step=step)
    for name, prompt, step in [("paper", STEP_DELIMITER, STEP_DELIMITER), ("model-card", "", STEP_TAG)]
}
