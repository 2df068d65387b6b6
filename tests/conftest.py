"""Shared fixtures: small random checkpoints written once per session through the real saving code."""

import importlib.util
import os
import signal
from collections import Counter
from pathlib import Path

# One compute thread per process (this one and the CLI, Ray and rank subprocesses it starts, which inherit it) unless
# the environment names another count: the tests' models are tiny, and a second OpenMP thread that has to wait for a
# core held by another process makes each small matrix product take milliseconds instead of microseconds (a
# 64-wide linear layer: 5.6 ms on two threads, 0.02 ms on one, on 2 busy cores; docs/benchmarks.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A thread that finds no work sleeps at once (libgomp's OMP_WAIT_POLICY, read as torch loads it) rather than spinning
# for its turn: where a test computes on two threads (tests/engine/test_invariance.py) beside the other test process
# and the suite's other parts, a spinning thread burnt a core's time the others were waiting for, and its own
# parallel regions waited for the spinner's core (the two-thread invariance run: 7.1 s alone beside one busy process,
# 2.2 s with it passive; docs/benchmarks.md). It changes when threads wait, not what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# vLLM's CPU workers pin themselves to the first core by default (VLLM_CPU_OMP_THREADS_BIND=auto keeps the other for
# the caller): the engines of two test processes would then share that core while the other idles.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# Ray starts its workers at niceness 15 (RAY_worker_niceness, read by each worker as it starts; the actors, and the
# TP ranks and vLLM engines they start, inherit it): beside the other test process and the vLLM part, which compute
# at niceness 0, an actor then gets a few percent of a core (2 s of CPU in 97 s beside busy processes) and the Ray
# tests took minutes instead of seconds. Every process of the suite competes alike with 0 (docs/development.md).
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvrescue.engine import invariance  # noqa: E402
from kvrescue_testkit.random_checkpoints import build_tokenizer, write_random_checkpoint  # noqa: E402
from tests import cuda_layouts  # noqa: E402
from tests.helpers import tiny_problems  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit():  # torch may have been imported before this file set it
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The vLLM tests (marker `vllm`, files test_vllm_*.py) run in .venv-vllm (`pytest -m vllm`). Elsewhere they are
# deselected, and their files are not even collected: a module that needs vLLM to import would count as skipped.
collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_vllm_*.py"]

# A suite started in the background (`&` in a script, nohup) inherits SIGINT ignored, and so would the processes that
# the Ctrl-C tests start and interrupt: handle it as an interactive run does (exec resets a handled signal to its
# default in a child, while an ignored one stays ignored).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The files that take longest in the suite (docs/benchmarks.md, "Test suite time"), longest first. scripts/test.sh keeps
# the order below (`--no-loadscope-reorder`): xdist hands each worker a file when it is nearly done with its last, so
# these start first and the short files fill in beside them, rather than one started last making the run's tail
# (xdist's own order, by number of tests, put the Ray and TP files in the second half; after this list, by the same
# rule, test_smollm's 2 tests and test_cell_runners' 1 took the last minute alone). The other files follow, those with
# more tests first.
SLOW_FIRST = (
    "tests/cli/test_engine_vllm.py",  # the vLLM part's (.venv-vllm, `-m vllm`)
    "tests/benchmarks/test_gpu_check_vllm.py",
    "tests/test_workers.py",  # marked `waiting`: scripts/test.sh runs these two in a process of their own
    "tests/engine/test_tp.py",
    "tests/benchmarks/test_gpu_check.py",  # the main part's
    "tests/cli/test_run_options.py",
    "tests/cli/test_run.py",
    "tests/engine/test_invariance.py",
    "tests/test_memory_plan.py",
    "tests/test_smollm.py",
    "tests/cli/test_hostile_files.py",
    "tests/cli/test_hand_edited.py",
    "tests/kvrescue_testkit/test_fake_cuda.py",
    "tests/engine/test_steps.py",
    "tests/engine/test_flex.py",
    "tests/engine/test_bounded.py",
    "tests/engine/test_graphs.py",
    "tests/test_cell_runners.py",
    "tests/kvrescue_testkit/test_stream_order.py",
    "tests/grader/test_units.py",
    "tests/grader/test_timeouts.py",
    "tests/engine/test_syncs.py",
    "tests/test_hub.py",
    "tests/grader/test_security.py",
    "tests/report/test_report.py",
    "tests/report/test_paper_oracle.py",
    "tests/view/test_view.py",
    "tests/test_cell_memory.py",
    "tests/benchmarks/test_gpu_check_streams.py",
    "tests/test_devices.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in the order above (a file's tests stay together, in their order); a file of the list that is gone (moved,
    renamed) stops the run, so that the list moves with it."""
    gone = [name for name in SLOW_FIRST if not (config.rootpath / name).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: SLOW_FIRST names {', '.join(gone)}, not in the repository")

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    tests = Counter(map(file_of, items))
    rank = {name: place for place, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: (rank.get(file_of(item), len(rank)), -tests[file_of(item)], file_of(item)))


@pytest.fixture(autouse=True)
def batch_invariance_off():
    """Batch invariance is a process-wide switch that a cell's build sets (`--deterministic` in a run in the test's
    process leaves it on): every test starts and ends with it off, whatever ran before it in the worker."""
    invariance.enable(False)
    yield
    invariance.enable(False)


TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, init_std=0.1)
# vLLM's CPU attention takes head sizes from 32 up: the checkpoints its tests load have 2 query heads of 32, 1 KV head.
VLLM_TINY = dict(TINY, num_heads=2, num_kv_heads=1)


@pytest.fixture(params=["cpu-layouts", "cuda-layouts"])
def kernel_layouts(request, monkeypatch) -> cuda_layouts.KernelLayouts:
    """Each test of a module marked `pytest.mark.usefixtures("kernel_layouts")` runs twice: with the CPU
    kernels' layouts, and with SDPA returning CUDA's (`tests.cuda_layouts`); a test taking it as an argument
    wraps its flash-attn stand-in with `.flash`. (A subprocess computes with CUDA's given
    `cuda_layouts.subprocess_env()`.)"""
    cuda = request.param == "cuda-layouts"
    if cuda:
        cuda_layouts.install(monkeypatch.setattr)
    return cuda_layouts.KernelLayouts(cuda)


@pytest.fixture(scope="session")
def problems(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny.jsonl: six additions (`tests.helpers.PAIRS`), read by the tests' runs (none writes to it)."""
    return tiny_problems(tmp_path_factory.mktemp("data") / "tiny.jsonl")


def checkpoint_fixture(name: str, arch: str, seed: int, doc: str, **shape):
    """A session fixture `name`: a random `arch` checkpoint (TINY, updated with `shape`) written once, in a
    folder named after its architecture (the PRM recipes' choice reads a folder's name)."""

    @pytest.fixture(scope="session", name=name)
    def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return write_random_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=seed, **{**TINY, **shape})

    folder.__doc__ = doc
    return folder


qwen2_dir = checkpoint_fixture("qwen2_dir", "qwen2", 1, "A random Qwen2 checkpoint (q/k/v bias, GQA, untied head, rope "
                               "theta 5000).", rope_theta=5000.0)
qwen3_dir = checkpoint_fixture("qwen3_dir", "qwen3", 6, "A random Qwen3 checkpoint (q/k norms, head_dim 32 = twice "
                               "hidden / heads, no bias, tied embeddings).", rope_theta=1e6)
llama_dir = checkpoint_fixture("llama_dir", "llama", 2, "A random Llama checkpoint (no bias, tied embeddings).")
prm_dir = checkpoint_fixture("prm_dir", "prm", 3, "A random Qwen2ForProcessRewardModel checkpoint (Qwen2 decoder + "
                             "score head).")
rlhflow_dir = checkpoint_fixture("rlhflow_dir", "rlhflow", 7, "A random RLHFlow-shaped PRM: Llama 3.1-like (untied LM "
                                 "head), Llama 3's tokenizer and chat template.")
math_shepherd_dir = checkpoint_fixture("math_shepherd_dir", "math-shepherd", 8, "A random Math-Shepherd-shaped PRM: "
                                       "MistralForCausalLM, a Mistral-like tokenizer holding \"ки\".")
skywork_dir = checkpoint_fixture("skywork_dir", "skywork", 9, "A random Skywork-o1-Open-PRM-shaped PRM: Qwen2 with the "
                                 "value head v_head.summary, a tokenizer with a BOS.")
vllm_prm_dir = checkpoint_fixture("vllm_prm_dir", "prm", 3, "A random Qwen2ForProcessRewardModel checkpoint in a shape "
                                  "vLLM's CPU build runs.", **VLLM_TINY)
vllm_rlhflow_dir = checkpoint_fixture("vllm_rlhflow_dir", "rlhflow", 7, "An RLHFlow-shaped PRM in a shape vLLM's CPU "
                                      "build runs.", **VLLM_TINY)
vllm_math_shepherd_dir = checkpoint_fixture("vllm_math_shepherd_dir", "math-shepherd", 8, "A Math-Shepherd-shaped "
                                            "PRM in a shape vLLM's CPU build runs.", **VLLM_TINY)


@pytest.fixture(scope="session")
def vllm_prm(vllm_prm_dir: Path):
    """One vLLM pooling engine on `vllm_prm_dir`, fp32, shared by the session (a start costs 20-30 s, minutes
    under load); its KV cache is kept small, since vLLM reserves it up front."""
    from kvrescue.vllm_engine.llm import start_llm

    llm = start_llm(vllm_prm_dir, dtype="float32", max_model_len=4096, runner="pooling", kv_cache_bytes=64 << 20,
                    enforce_eager=True)
    yield llm
    llm.llm_engine.engine_core.shutdown()  # now, while pytest's streams still take vLLM's log lines


@pytest.fixture(scope="session")
def step_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 checkpoint vLLM's CPU attention takes (head size 32), its head rows of the newline token
    ×5 and of EOS ×2.5 so that sampled steps end by each rule (delimiter, EOS, cap) within a few dozen tokens."""
    from safetensors.torch import load_file, save_file

    folder = write_random_checkpoint(tmp_path_factory.mktemp("step_qwen2"), "qwen2", seed=5, **VLLM_TINY)
    weights = load_file(folder / "model.safetensors")
    tokenizer = build_tokenizer()
    weights["lm_head.weight"][tokenizer.encode("\n")] *= 5.0
    weights["lm_head.weight"][tokenizer.eos_token_id] *= 2.5
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def cluster():
    """Two Ray nodes of one CPU each on this machine (Ray's own test cluster): an actor on each. Shared by the
    session (test_tp, test_workers); a test that adds a node removes it."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=80 * 2**20,
                                                              include_dashboard=False))
    nodes.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    nodes.wait_for_nodes()
    yield nodes
    nodes.shutdown()
