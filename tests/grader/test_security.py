"""Grading never executes its input, and its workers are confined and distrusted."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from grader import GRADERS, grade, grade_many
from grader.sandbox import SymbolicPool
from tests.helpers import ROOT, kvrescue

# Each payload, evaluated as Python, creates {p}; each survives strip_string and is refused by every
# parser (the reference then hands it to sympify). `__name__` first keeps parse_latex from reading a prefix.
PAYLOADS = {
    "import": "__import__('pathlib').Path('{p}').mkdir()",
    "open": "(__name__,open)[1]('{p}','w').write('1')",
    "lambda": "(lambda:__import__('pathlib').Path('{p}').mkdir())()",
    "getattr": "(__name__,getattr)[1](__import__('pathlib'),'Path')('{p}').mkdir()",
    "attribute_chain": "__import__('pathlib').Path('{p}').parent.joinpath('pwned').mkdir()",
    "exec": "exec(\"__import__('pathlib').Path('{p}').mkdir()\")",
    "eval": "eval(\"__import__('pathlib').Path('{p}').mkdir()\")",
    "builtins_lookup": "(__name__,globals)[1]()['__builtins__']['__import__']('pathlib').Path('{p}').mkdir()",
    "text_wrapper": "\\text{__import__('pathlib').Path('{p}').mkdir()}",
}


@pytest.fixture
def marker():
    folder = Path(tempfile.mkdtemp(prefix="kvrsec"))
    yield folder / "pwned"
    for leftover in folder.iterdir():
        leftover.rmdir() if leftover.is_dir() else leftover.unlink()
    folder.rmdir()


@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.parametrize("side", ["prediction", "answer"])
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_payload_is_never_executed(name: str, side: str, grader: str, marker: Path) -> None:
    payload = PAYLOADS[name].replace("{p}", str(marker))
    output = "The answer is $\\boxed{" + (payload if side == "prediction" else "x+1") + "}$."
    gt = payload if side == "answer" else "x+1"
    result = grade(output, gt, "math500", timeout=10.0, grader=grader)
    assert not marker.exists(), f"{name} ran on the {side} side"
    assert not result.timed_out
    assert not result.correct


def test_unicode_minus_is_not_a_minus_sign() -> None:
    """The reference's latex2sympy has no U+2212 token, so '\u22125' is not -5 there; nor here."""
    items = [("\\boxed{\u22125}", "-5", "gsm8k"), ("\\boxed{-5}", "\u22125", "gsm8k"),
             ("\\boxed{x\u22121}", "x-1", "math500"), ("\\boxed{\u22125}", "\u22125", "gsm8k")]
    assert [r.correct for r in grade_many(items, timeout=10.0)] == [False, False, False, True]


CONFINED_PROBE = textwrap.dedent("""
    import ctypes, errno, fcntl, json, os, resource, socket, subprocess, sys, termios
    from grader.confine import confine
    keep = os.dup(1)
    existing = sys.argv[1]
    layers = confine(keep)

    def blocked(action):
        try:
            action()
        except (OSError, MemoryError):
            return True
        return False

    def refused(action):  # EPERM from the filter (on a pipe the call would fail with ENOTTY anyway)
        try:
            action()
        except OSError as e:
            return e.errno == errno.EPERM
        return False

    def append():
        with open(existing, "a") as f:
            f.write("more")

    libc = ctypes.CDLL(None, use_errno=True)
    # syscall numbers from the kernel's headers (asm/unistd_64.h, asm-generic/unistd.h), independent of confine.py's
    X86_64 = {"iopl": 172, "ioperm": 173, "keyctl": 250, "shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240,
              "setrlimit": 160, "prlimit64": 302}
    AARCH64 = {"keyctl": 219, "shmget": 194, "semget": 190, "msgget": 186, "mq_open": 180, "setrlimit": 164,
               "prlimit64": 261}

    def syscall_refused(name, *args):  # straight to the kernel (no libc wrapper that might try another call)
        number = {"x86_64": X86_64, "aarch64": AARCH64}[os.uname().machine][name]
        done = libc.syscall(ctypes.c_long(number), *map(ctypes.c_long, args))
        return done == -1 and ctypes.get_errno() == errno.EPERM

    # A new memory limit: even a lower soft limit (which needs no privilege) is refused, so no limit can be lifted.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    lower = (ctypes.c_uint64 * 2)(soft - 4096, hard)

    result = {
        "layers": layers,
        "spawn": blocked(lambda: subprocess.run(["true"])),
        "fork": blocked(os.fork),
        "create": blocked(lambda: open(existing + ".new", "w")),
        "append": blocked(append),
        "mkdir": blocked(lambda: os.mkdir(existing + ".dir")),
        "unlink": blocked(lambda: os.unlink(existing)),
        "socket": blocked(lambda: socket.socket()),
        "signal_parent": blocked(lambda: os.kill(os.getppid(), 0)),
        "type_into_terminal": refused(lambda: fcntl.ioctl(0, termios.TIOCSTI, b"x")),
        "memory": blocked(lambda: bytearray(5 << 30)),
        "read": not blocked(lambda: open(existing).read()),
        "setrlimit": syscall_refused("setrlimit", resource.RLIMIT_AS, ctypes.addressof(lower)),
        "prlimit64": syscall_refused("prlimit64", 0, resource.RLIMIT_AS, ctypes.addressof(lower), 0),
        "read_limits": resource.getrlimit(resource.RLIMIT_AS)[0] > 0,  # prlimit64 without a new limit
        "iopl": os.uname().machine != "x86_64" or syscall_refused("iopl", 3),
        "ioperm": os.uname().machine != "x86_64" or syscall_refused("ioperm", 0, 1024, 1),
        "keyctl": syscall_refused("keyctl", 0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
        "shmget": syscall_refused("shmget", 0, 4096, 0o1600),  # IPC_PRIVATE, IPC_CREAT | 0600
        "semget": syscall_refused("semget", 0, 1, 0o1600),
        "msgget": syscall_refused("msgget", 0, 0o1600),
        "mq_open": syscall_refused("mq_open", ctypes.cast(ctypes.c_char_p(b"kvq"), ctypes.c_void_p).value,
                                   0o100 | 2, 0o600, 0),  # O_CREAT | O_RDWR

        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "keep": keep,
    }
    os.write(keep, json.dumps(result).encode())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="confinement is Linux-only")
def test_confined_process_can_do_nothing_but_compute(tmp_path: Path) -> None:
    existing = tmp_path / "existing.txt"
    existing.write_text("data")
    inherited = open(tmp_path / "inherited", "w")  # an extra descriptor the probe inherits
    done = subprocess.run([sys.executable, "-c", CONFINED_PROBE, str(existing)], capture_output=True,
                          pass_fds=(inherited.fileno(),), cwd=ROOT, timeout=120)
    inherited.close()
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["layers"] == {"limits": True, "syscall_filter": True}
    for action in ("spawn", "fork", "create", "append", "mkdir", "unlink", "socket", "signal_parent",
                   "type_into_terminal", "memory", "read", "setrlimit", "prlimit64", "read_limits", "iopl", "ioperm",
                   "keyctl", "shmget", "semget", "msgget", "mq_open"):
        assert result[action], action
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.txt", "inherited"]
    assert existing.read_text() == "data"
    # stdin, stdout and stderr (both /dev/null by now), the kept channel, and the listing's own descriptor
    assert [fd for fd in result["fds"] if fd not in (0, 1, 2, result["keep"])] in ([], [max(result["fds"])])


def test_grading_workers_report_confinement() -> None:
    pool = SymbolicPool()
    try:
        [reply] = pool.run([("compare", "x^2+2x+1", "(x+1)^2")], timeout=10.0)
        assert set(reply) == {"id", "correct"} and reply["correct"] is True
        assert pool.confinement == [{"limits": True, "syscall_filter": True}]
    finally:
        pool.close()


# Workers that answer outside the protocol; the parent must take none of it as a verdict.
ROGUE_WORKERS = {
    "bare_verdict": 'print("true", flush=True)',
    "wrong_id": 'print(json.dumps({"id": "0" * 32, "correct": True}), flush=True)',
    "extra_key": 'print(json.dumps({"id": rid, "correct": True, "pred": "x"}), flush=True)',
    "not_bool": 'print(json.dumps({"id": rid, "correct": 1}), flush=True)',
    "two_lines": 'print(json.dumps({"id": rid, "correct": True}) + "\\n" + json.dumps({"id": rid, "correct": True}), flush=True)',
    "huge": 'print(json.dumps({"id": rid, "correct": True, "pad": "x" * 10_000_000}), flush=True)',
    "silent_exit": "sys.exit(0)",
}


@pytest.mark.parametrize("behaviour", sorted(ROGUE_WORKERS))
def test_parent_trusts_only_a_well_formed_verdict_for_its_request(behaviour: str) -> None:
    script = textwrap.dedent("""
        import json, sys
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            kind, rid, *args = json.loads(line)
            if args[0] == "honest":
                print(json.dumps({"id": rid, "correct": True}), flush=True)
                continue
    """) + "    " + ROGUE_WORKERS[behaviour] + "\n"
    pool = SymbolicPool(command=[sys.executable, "-c", script])
    try:
        start = time.monotonic()
        replies = pool.run([("compare", "rogue", "1"), ("compare", "honest", "1")], timeout=30.0)
        assert replies[0] is None
        assert replies[1] is not None and replies[1]["correct"] is True
        assert time.monotonic() - start < 25.0  # refused on sight, not at the deadline
    finally:
        pool.close()


@pytest.mark.parametrize("grader", GRADERS)
def test_whole_item_grading_is_bounded_by_the_timeout(grader: str) -> None:
    """A 4 MB output (extraction alone takes seconds) ends within the limit, as a timeout."""
    grade("\\boxed{x^2}", "x*x", "math500", grader=grader)  # a warm worker: start-up is not part of the limit
    output = "\\boxed{" + "x+1 " * 1_000_000 + "}"
    start = time.monotonic()
    result = grade(output, "5", "math500", timeout=1.0, grader=grader)
    assert time.monotonic() - start < 4.0
    assert result.timed_out and not result.correct and result.symbolic
    if grader != "qwen":
        return
    long_but_easy = "reasoning " * 5_000 + "so \\boxed{5}"
    result = grade(long_but_easy, "5", "math500", timeout=10.0)
    assert (result.correct, result.pred, result.gt, result.symbolic) == (True, "5", "5", True)
    non_ascii = "é−" * 15_000 + "so \\boxed{π𝑥}"  # text, pred and gt round-trip intact
    result = grade(non_ascii, "π𝑥", "math500", timeout=10.0)
    assert (result.correct, result.pred, result.gt, result.symbolic) == (True, "π𝑥", "π𝑥", True)


def test_kvrescue_grade_and_run_never_execute_their_input(marker: Path, qwen2_dir: Path, prm_dir: Path,
                                                          tmp_path: Path) -> None:
    """End to end (the CLI in this process): payloads in a JSONL's outputs and answers, and in a problem file's
    answers."""
    payloads = [PAYLOADS[name].replace("{p}", str(marker)) for name in sorted(PAYLOADS)]
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps(r) + "\n" for p in payloads
                               for r in ({"output": f"\\boxed{{{p}}}", "gt": "x+1"}, {"output": "\\boxed{x}", "gt": p})))
    for grader in GRADERS:
        done = kvrescue("grade", str(outputs), "--bench", "math500", "--grader", grader)
        assert done.returncode == 0, done.stderr.decode()
        assert not marker.exists()
        assert [json.loads(line)["correct"] for line in done.stdout.splitlines()] == [False] * 2 * len(payloads)
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"question": "What is x?", "answer": p}) + "\n" for p in payloads[:2]))
    done = kvrescue("run", "--bench", str(problems), "--method", "bon", "--n", "1", "--base", str(qwen2_dir), "--prm",
                    str(prm_dir), "--out", str(tmp_path / "out"), "--max-step-tokens", "8", "--max-steps", "2",
                    "--context-cap", "320", "--device", "cpu", "--batch", "2", "--also-grade", "math-verify")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert not marker.exists()
    traces = [json.loads(line) for f in (tmp_path / "out").glob("*/*/traces.jsonl") for line in f.read_text().splitlines()]
    assert len(traces) == 2 and all(set(t["graders"]) == {"math-verify"} for t in traces)
    done = kvrescue("grade", "--runs", str(tmp_path / "out"), "--grader", "math-verify")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert not marker.exists() and len(done.stdout.splitlines()) == 2
