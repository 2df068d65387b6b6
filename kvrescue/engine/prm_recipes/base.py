"""What a PRM recipe says (one recipe per file beside this one, as kvpress has one press per file).

A recipe names the head its checkpoint carries (and so the architecture that loads it) and, bound to the PRM's
tokenizer, builds the input of a trajectory as token ids: the prompt, then one piece per step. A candidate's
piece ends where its score is read; a committed step's piece may carry more (a chat reply), so that the prompt
and the committed pieces are the model card's input of the whole trajectory. The scorers (engine/prm.py,
vllm_engine/prm.py) cache the prompt and the committed pieces once and score candidates as suffixes, reading
`score` of the head's output at each candidate's last token. No torch here; the grid checks `--prm-recipe` against
the names of `kvrescue.prm_catalogue`, which the registry's recipes carry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrescue.prompts import STEP_DELIMITER

# The heads a PRM checkpoint can carry, as the loader builds them (engine/loader.py) and its errors name them.
HEADS = {
    "classes": "a 2-class process-reward head (score.0/score.2 weights, Qwen2ForProcessRewardModel)",
    "lm": "a language-model head",
    "value": "a value head (v_head.summary weights)",
}
END_MARKERS = ("<|im_end|>", "<|endoftext|>")  # the policy's end-of-text tokens, cut off a step's text


def prm_step_text(text: str) -> str:
    """A generated step as the PRM sees it: cut at an end-of-text marker, without the `\\n\\n` delimiter."""
    for marker in END_MARKERS:
        text = text.split(marker)[0]
    return text.split(STEP_DELIMITER)[0]


class RecipeInputs(ABC):
    """A recipe bound to its PRM's tokenizer: token ids in, scores out (read from the head's outputs at `columns`,
    None: all of them)."""

    columns: list[int] | None = None

    @abstractmethod
    def prompt(self, problem: str, system: str) -> list[int]:
        """The ids before the first step."""

    @abstractmethod
    def candidates(self, texts: Sequence[str], index: Sequence[int]) -> list[list[int]]:
        """Each generated step's piece as a candidate (`index`: steps committed before it); each ends where its score
        is read."""

    def committed(self, text: str, index: int) -> list[int]:
        """A committed step's piece (the candidate's, unless the recipe's input carries more after it)."""
        return self.candidates([text], [index])[0]

    @abstractmethod
    def score(self, head: Any) -> Any:
        """Scores in [0, 1] [R] from the head's outputs at the candidates' last tokens, those of `columns` where it
        is set [R, out] (a torch tensor)."""

    def read(self, head: Any) -> Any:
        """Scores from the head's whole outputs at the candidates' last tokens [R, out]."""
        return self.score(head if self.columns is None else head[:, self.columns])


class LabelInputs(RecipeInputs):
    """A recipe read from the language-model head: its `columns` are the ids of the labels "+" and "-", and a
    step's score is softmax over their logits, index 0 (P("+") against P("-"))."""

    def score(self, head):
        return head.softmax(-1)[:, 0]


@dataclass(frozen=True)
class PRMRecipe(ABC):
    """A PRM's recipe: its registry name, the head its checkpoint carries (`HEADS`), the architecture that loads it,
    and why vLLM 0.32 cannot score with it (None: it can)."""

    name: str
    head: str
    architecture: str
    no_vllm: str | None

    @abstractmethod
    def bind(self, tokenizer, model: str) -> RecipeInputs:
        """The recipe on this tokenizer; a ValueError naming `model` when the tokenizer cannot take it."""


def encode_after(tokenizer, anchor: str, texts: Sequence[str], model: str) -> list[list[int]]:
    """Each text's ids as the tokenizer makes them after `anchor` (without special tokens): a SentencePiece-style
    tokenizer adds a word-start mark to a text tokenised on its own, not to one that follows the anchor."""
    head = tokenizer.encode(anchor, add_special_tokens=False)
    out = []
    for ids in (tokenizer.encode(anchor + text, add_special_tokens=False) for text in texts):
        if ids[: len(head)] != head:
            raise ValueError(f"{model}: its tokenizer merges {anchor!r} with what follows it; the recipe cannot "
                             "split its input into pieces")
        out.append(ids[len(head):])
    return out


def last_token_id(tokenizer, text: str, model: str) -> int:
    """`tokenizer.encode(text)[-1]`, as the model cards take their tag and label ids."""
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"{model}: its tokenizer makes no token of {text!r}")
    return ids[-1]
