"""Killable, confined worker processes for the grading work that needs sympy or unbounded time.

A worker imports sympy once, warms its parsers up, confines itself (`grader.confine`: no processes, no
file writes, bounded memory, no inherited descriptors), says it is ready, then answers requests one
at a time:

    ["compare", id, pred, gt]          -> {"id": id, "correct": bool}
    ["grade", id, output, gt, bench]   -> {"id": id, "correct": bool, "pred": str, "gt": str}
    ["verify", id, output, gt]         -> the same, by Math-Verify (`grader.verify`; where it is installed)

The parent gives each request a wall-clock limit counted from when it is sent and a fresh random id.
It trusts nothing else: a reply that is not exactly one well-formed line for the request in flight,
a worker that overruns or dies, each ends with the worker killed, the request reported as None and a
fresh worker in its place.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from pathlib import Path

Request = tuple  # ("compare", pred, gt), ("grade", output, gt, bench) or ("verify", output, gt)
_REPLY_KEYS = {"compare": {"id", "correct"}, "grade": {"id", "correct", "pred", "gt"},
               "verify": {"id", "correct", "pred", "gt"}}
ReplyParser = Callable[[bytes, str, str], "dict | None"]  # (line, kind, request id) -> the reply, None if malformed
_STARTUP_LIMIT_S = 120.0
_READY_MAX_BYTES = 256


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, even mid-computation (no-op elsewhere).

    Used by the grading workers and by `kvrescue run`'s decode workers."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, ctypes.c_ulong(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def serve_requests(warm_up: Callable[[], None], answer: Callable[[str, str, list], dict]) -> None:
    """Worker loop: `warm_up` (imports, first calls) before confinement, then answer JSON request lines
    `[kind, id, *args]` on stdin with `answer(kind, id, args)` as JSON reply lines until EOF."""
    die_with_parent()
    sys.dont_write_bytecode = True
    # Keep the answer channel to ourselves: anything a library prints goes to stderr (later /dev/null).
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)

    from grader.confine import confine

    warm_up()
    confined = confine(answers.fileno())
    answers.write(json.dumps({"ready": True, **confined}) + "\n")
    answers.flush()
    for line in sys.stdin:
        kind, request_id, *args = json.loads(line)
        answers.write(json.dumps(answer(kind, request_id, args)) + "\n")
        answers.flush()


def serve() -> None:
    """The grading worker: `serve_requests` with sympy's parsers warmed up."""
    serve_requests(_warm_up_grading, _grading_answer)


def _warm_up_grading() -> None:
    from grader.pipeline import grade_item
    from grader.symbolic import symbolic_equal
    from grader.verify import available, verify_item

    # Warm the parsers up (the first parse_latex call alone takes about a second) so that the time
    # limit measures comparisons, not start-up; also loads every module the comparisons import.
    grade_item("so \\boxed{\\frac{x^2}{2}}", "0.5x*x", "math500", symbolic_equal)
    symbolic_equal("\\frac{(}{", "1")  # rejected by parse_latex: warms parse_expr and latex2sympy
    symbolic_equal("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "x=1")
    if available():
        verify_item("so \\boxed{\\frac{x^2}{2}} and $\\begin{pmatrix}1\\\\2\\end{pmatrix}$", "0.5x*x")


def _grading_answer(kind: str, request_id: str, args: list) -> dict:
    from grader.equal import math_equal
    from grader.pipeline import grade_item
    from grader.symbolic import symbolic_equal
    from grader.verify import verify_item

    reply = {"id": request_id}
    try:
        if kind == "compare":
            reply["correct"] = math_equal(*args, symbolic_equal)
        elif kind == "verify":
            reply["correct"], reply["pred"], reply["gt"] = verify_item(*args)
        else:
            reply["correct"], reply["pred"], reply["gt"] = grade_item(*args, symbolic_equal)
    except Exception:  # scored incorrect (the reference harness would stop at this point)
        reply = {"id": request_id, "correct": False, **({"pred": "", "gt": ""} if kind != "compare" else {})}
    return reply


def _parse_reply(line: bytes, kind: str, request_id: str) -> dict | None:
    """The reply when `line` is exactly a well-formed answer to request `request_id`, else None."""
    try:
        reply = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(reply, dict) or set(reply) != _REPLY_KEYS[kind] or reply["id"] != request_id:
        return None
    if not isinstance(reply["correct"], bool):
        return None
    if kind != "compare" and not (isinstance(reply["pred"], str) and isinstance(reply["gt"], str)):
        return None
    return reply


class _Slot:
    """One worker process and the request it is running, if any."""

    def __init__(self, command: Sequence[str], parse_reply: ReplyParser) -> None:
        self.command, self.parse_reply = list(command), parse_reply
        self.process: subprocess.Popen[bytes] | None = None
        self.ready = False
        self.confinement: dict | None = None
        self.task: int | None = None
        self.kind = ""
        self.request_id = ""
        self.reply_limit = 0
        self.buffer = b""
        self.deadline = 0.0
        self.started = 0.0

    def start(self) -> None:
        # A fresh interpreter (not fork: the caller may hold threads; not multiprocessing's spawn: it
        # re-runs the caller's main script). The package's parent folder goes on its import path.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.ready, self.task, self.buffer, self.started = False, None, b"", time.monotonic()

    def send(self, task: int, request: Request, timeout: float) -> None:
        self.task, self.kind, self.request_id = task, request[0], secrets.token_hex(16)
        payload = json.dumps([request[0], self.request_id, *request[1:]]).encode("ascii")
        self.reply_limit = 1024 + 6 * len(payload)  # a reply echoes at most the request's strings, escaped
        self.deadline = time.monotonic() + timeout
        try:
            self.process.stdin.write(payload + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it died: noticed when its output closes
            pass

    def read(self) -> bytes | None:
        """One complete line, b"" at end of output or on a breach (too long, or more than one line),
        None while a line is still incomplete."""
        chunk = os.read(self.process.stdout.fileno(), 1 << 16)
        if not chunk:
            return b""
        self.buffer += chunk
        limit = self.reply_limit if self.ready else _READY_MAX_BYTES
        line, newline, rest = self.buffer.partition(b"\n")
        if rest or len(line) > limit:
            return b""
        if not newline:
            return None
        self.buffer = b""
        return line

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process.stdin.close()
            self.process.stdout.close()
        self.process, self.ready, self.task = None, False, None


WORKER_COMMAND = (sys.executable, "-c", "from grader.sandbox import serve; serve()")


class SymbolicPool:
    """Worker processes for grading requests (or, with another `command` and `parse_reply`, any requests a
    `serve_requests` worker answers), each under a hard time limit."""

    def __init__(self, command: Sequence[str] = WORKER_COMMAND, parse_reply: ReplyParser = _parse_reply) -> None:
        self._command, self._parse_reply = command, parse_reply
        self._slots: list[_Slot] = []

    @property
    def confinement(self) -> list[dict]:
        """What each ready worker reported of its confinement (`grader.confine.confine`)."""
        return [s.confinement for s in self._slots if s.ready]

    def run(self, requests: Sequence[Request], timeout: float, workers: int = 1) -> list[dict | None]:
        """Replies to `requests` in order; None where the limit ran out, the worker died or broke protocol."""
        results: list[dict | None] = [None] * len(requests)
        pending = deque(range(len(requests)))
        while len(self._slots) < workers:
            self._slots.append(_Slot(self._command, self._parse_reply))
        slots = self._slots[:workers]
        outstanding = len(requests)
        while outstanding:
            for slot in slots:
                if slot.process is None:
                    slot.start()
                if slot.ready and slot.task is None and pending:
                    task = pending.popleft()
                    slot.send(task, requests[task], timeout)
            live = [s for s in slots if s.process is not None]
            horizon = min(
                [s.deadline for s in live if s.task is not None]
                + [s.started + _STARTUP_LIMIT_S for s in live if not s.ready]
            )
            readable = wait([s.process.stdout for s in live], max(0.0, horizon - time.monotonic()))
            for slot in live:
                outstanding -= self._collect(slot, slot.process.stdout in readable, results)
        return results

    def _collect(self, slot: _Slot, readable: bool, results: list[dict | None]) -> int:
        """Take what `slot` has to say; returns how many requests it finished (0 or 1)."""
        line = slot.read() if readable else None
        if line and not slot.ready:
            ready = _parse_ready(line)
            if ready is not None:
                slot.ready, slot.confinement = True, ready
                return 0
        elif line and slot.task is not None:
            reply = slot.parse_reply(line, slot.kind, slot.request_id)
            if reply is not None:
                results[slot.task] = reply
                slot.task = None
                return 1
        now = time.monotonic()
        if line is None and slot.task is None and not slot.ready and now >= slot.started + _STARTUP_LIMIT_S:
            raise RuntimeError(f"grader worker did not start within {_STARTUP_LIMIT_S:.0f} s")
        if line is None and (slot.task is None or now < slot.deadline):
            return 0
        # Overran its limit, died, or said something other than the one reply it owed.
        if not slot.ready:
            slot.stop()
            raise RuntimeError("grader worker failed during start-up")
        finished = int(slot.task is not None)
        slot.stop()
        slot.start()  # right away, so the replacement warms up while others work
        return finished

    def close(self) -> None:
        """Stop every worker; the pool starts new ones if used again."""
        for slot in self._slots:
            slot.stop()
        self._slots.clear()


def _parse_ready(line: bytes) -> dict | None:
    try:
        ready = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(ready, dict) or ready.get("ready") is not True:
        return None
    return {k: v for k, v in ready.items() if k != "ready"}
