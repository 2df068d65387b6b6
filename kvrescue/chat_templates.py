"""Chat templates rendered in a confined worker process, under a time and a memory bound.

A model folder's chat template is a Jinja program read from an untrusted file: even in jinja2's sandbox, nested
loops run for ever and `'x' * 10**10` fills memory. kvrescue renders every template through transformers' own
renderer (so the text is what `apply_chat_template` gives) in a worker of the grader's kind (`grader.sandbox`: no
new processes, no file writes, `grader.confine.MEMORY_LIMIT_BYTES` of memory, a reply at most a few times the
request's size) under a wall-clock limit per request. A template that fails, overruns or kills its worker is a
one-line ChatTemplateError naming the model.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence

from grader.confine import MEMORY_LIMIT_BYTES
from grader.sandbox import SymbolicPool, serve_requests
from kvrescue.errors import InputError

RENDER_TIMEOUT_S = 10.0
WORKER_COMMAND = (sys.executable, "-c", "from kvrescue.chat_templates import serve; serve()")
Messages = list[dict[str, str]]


class ChatTemplateError(InputError):
    """A model's chat template failed or ran past its bounds; the message names the model."""


def render_chats(tokenizer, conversations: Sequence[Messages], **options) -> list[str]:
    """The text of each conversation under the tokenizer's chat template, as `tokenizer.apply_chat_template(...,
    tokenize=False, **options)` renders it (`options`: add_generation_prompt, template variables)."""
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    variables = {**tokenizer.special_tokens_map, **options}
    request = ("render", tokenizer.get_chat_template(), list(conversations), variables)
    with _lock:
        reply = _pool.run([request], RENDER_TIMEOUT_S)[0]
    if reply is None:
        raise ChatTemplateError(f"{name}: its chat template ran past its bounds ({RENDER_TIMEOUT_S:.0f} s, "
                                f"{MEMORY_LIMIT_BYTES >> 30} GiB of memory, or an output out of proportion to its "
                                "input)")
    if "error" in reply:
        raise ChatTemplateError(f"{name}: its chat template failed ({reply['error']})")
    if len(reply["texts"]) != len(conversations):
        raise ChatTemplateError(f"{name}: its chat template's worker answered for another number of conversations")
    return reply["texts"]


def render_chat(tokenizer, messages: Messages, **options) -> str:
    """One conversation's text (`render_chats`)."""
    return render_chats(tokenizer, [messages], **options)[0]


def serve() -> None:
    """The rendering worker (`WORKER_COMMAND`)."""
    serve_requests(_warm_up, _answer)


def _warm_up() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    render_jinja_template([[{"role": "user", "content": "x"}]], chat_template="{{ messages[0]['content'] }}")


def _answer(kind: str, request_id: str, args: list) -> dict:
    from transformers.utils.chat_template_utils import render_jinja_template

    template, conversations, variables = args
    try:
        texts, _ = render_jinja_template(conversations, chat_template=template, **variables)
    except Exception as e:  # SecurityError, TemplateSyntaxError, TemplateError, RecursionError, MemoryError, ...
        return {"id": request_id, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    return {"id": request_id, "texts": texts}


def _parse_reply(line: bytes, kind: str, request_id: str) -> dict | None:
    """The reply when `line` is exactly a well-formed answer to request `request_id`, else None."""
    try:
        reply = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(reply, dict) or reply.get("id") != request_id:
        return None
    if set(reply) == {"id", "error"} and isinstance(reply["error"], str):
        return reply
    texts = reply.get("texts")
    if set(reply) != {"id", "texts"} or not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return None
    return reply


_pool = SymbolicPool(WORKER_COMMAND, _parse_reply)
_lock = threading.Lock()
