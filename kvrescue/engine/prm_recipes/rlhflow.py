"""RLHFlow/Llama3.1-8B-PRM-Deepseek-Data (LlamaForCausalLM: the LM head reads the score).

The model card's input (RLHFlow's prm_evaluate.py, search-and-learn's `RLHFFlow._score_single`) is a chat
conversation rendered by the PRM's own template: one user turn per step, the first holding problem + " " + step 1,
each answered by an assistant turn "+". A step's score is softmax over the logits of ["+", "-"] (the ids
`tokenizer.encode("+")[-1]` and `encode("-")[-1]`), index 0, at the position before that step's "+" (the card's
`logits[:, -3, candidate_tokens]` of the conversation up to that step's reply).

Pieces, as differences of the template's renderings of the real contents (so its own headers, system block and
trimming of contents): the prompt is the conversation's text up to the end of the problem; a candidate's piece is
its turn up to where the assistant's "+" would start (" " + step for the first step, the user turn's header +
step after), and a committed step's piece also carries the "+" and the end of its turn. Each piece is tokenised
on its own: the boundaries fall before a special token, after the assistant header's "\\n\\n", and between the
problem and the space before step 1, where Llama 3's pre-tokenizer splits the whole text too. When older steps are
dropped to fit the window, the later turns follow the problem's text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrescue.chat_templates import render_chat, render_chats
from kvrescue.engine.prm_recipes.base import LabelInputs, PRMRecipe, RecipeInputs, last_token_id, prm_step_text
from kvrescue.engine.texts import encoder

HOLE = "\x00kvrescue-reply\x00"  # the assistant content while rendering a candidate's turn
CONTEXT = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "+"}]  # a turn before a later one


class RLHFlowRecipe(PRMRecipe):
    def bind(self, tokenizer, model: str) -> RecipeInputs:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{model}: the rlhflow recipe renders the PRM's chat template, and its tokenizer has none")
        return RLHFlowInputs(tokenizer, model)


class RLHFlowInputs(LabelInputs):
    def __init__(self, tokenizer, model: str) -> None:
        self.tokenizer, self.encode = tokenizer, encoder(tokenizer)
        self.columns = [last_token_id(tokenizer, "+", model), last_token_id(tokenizer, "-", model)]
        self.model = model
        self.after_context = self._render(CONTEXT)
        self.after_problem = self._problem_text("x")  # before a first step's turn (the problem's text changes nothing)

    def _render(self, messages: list[dict[str, str]]) -> str:
        return render_chat(self.tokenizer, messages)

    def _after(self, before: str, text: str) -> str:
        if not text.startswith(before):
            raise ValueError(f"{self.model}: its chat template does not render a conversation as its turns one after "
                             "another; the rlhflow recipe cannot build its input in pieces")
        return text[len(before):]

    def _problem_text(self, problem: str) -> str:
        rendered = self._render([{"role": "user", "content": problem + " " + HOLE}])
        return rendered[: rendered.index(" " + HOLE)]

    def prompt(self, problem: str, system: str) -> list[int]:
        """The conversation up to the end of the problem (the card has no system prompt: `system` is unused)."""
        return self.encode([self._problem_text(problem)])[0]

    def _turns(self, texts: Sequence[str], index: Sequence[int], reply: str) -> list[str]:
        """The text of each step's turn after what precedes it (the prompt, or an earlier turn), up to the reply's
        end (`reply` is "+"), or up to where it starts (`reply` is HOLE); the turns rendered in one request."""
        befores, conversations = [], []
        for text, i in zip(texts, index):
            step = prm_step_text(text)
            if i == 0:
                before, messages = self.after_problem, [{"role": "user", "content": "x " + step}]
            else:
                before, messages = self.after_context, CONTEXT + [{"role": "user", "content": step}]
            befores.append(before)
            conversations.append(messages + [{"role": "assistant", "content": reply}])
        turns = [self._after(b, r) for b, r in zip(befores, render_chats(self.tokenizer, conversations))]
        return [t[: t.index(HOLE)] for t in turns] if reply == HOLE else turns

    def candidates(self, texts: Sequence[str], index: Sequence[int]) -> list[list[int]]:
        return self.encode(self._turns(texts, index, HOLE))

    def committed(self, text: str, index: int) -> list[int]:
        return self.encode(self._turns([text], [index], "+"))[0]


RLHFLOW = RLHFlowRecipe("rlhflow", "lm", "LlamaForCausalLM", no_vllm=None)
