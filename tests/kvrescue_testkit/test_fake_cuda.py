"""The fake-CUDA dry run (`kvrescue_testkit.fake_cuda`, `kvrescue_testkit.dry_run`): the engine's CUDA path at the
paper's shapes (Qwen2.5-Math-7B base, 1.5B helper, PRM-7B) on fake tensors, without a GPU. Device, dtype, shape and
stride mistakes raise on the CPU as they would on a GPU; the CPU suite's real kernels cannot show them (contiguous
outputs, one device)."""

import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvrescue.cost import Architecture
from kvrescue_testkit.dry_run import dry_run
from kvrescue.engine import bounded, graphs
from kvrescue.engine import streams as model_streams
from kvrescue.engine.attention import attend_masked
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.loader import load_model
from kvrescue.engine.transfer import Download, upload_all
from kvrescue_testkit import stream_order
from kvrescue_testkit.fake_cuda import CaptureError, FakeCuda
from kvrescue.memory_plan import CellShape, DeviceKind, plan_cell
from kvrescue_testkit.paper_shapes import PAPER_MODELS, SMALL, SMALL_MODELS
from tests.dispatched import Dispatched

CUDA = torch.device("cuda:0")


def weight_bytes(shape: dict, prm: bool = False, itemsize: int = 2) -> int:
    """Bytes of a Qwen2 checkpoint of `shape`, counted here from its config (q/k/v biases; the PRM's score head
    instead of the LM head)."""
    h, v, inter, layers = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    head = h * h + h + 2 * h + 2 if prm else (0 if shape["tie_word_embeddings"] else v * h)
    return itemsize * (v * h + layers * layer + h + head)


def test_sdpa_takes_the_cuda_kernels_and_their_layouts():
    """bf16 with a mask: memory-efficient attention, whose output [B, H, M, K] lies as [B, M, H, K] in memory
    (PyTorch's attention.cu); without a mask: flash-attention. A `.view` of the grouped heads then fails, as on CUDA."""
    with FakeCuda():
        q = torch.empty(2, 4, 7 * 3, 128, dtype=torch.bfloat16, device=CUDA)  # 4 KV heads, 7 query heads each, 3 tokens
        k = torch.empty(2, 4, 50, 128, dtype=torch.bfloat16, device=CUDA)
        mask = torch.ones(2, 1, 21, 50, dtype=torch.bool, device=CUDA)
        masked = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        assert masked.shape == (2, 4, 21, 128) and masked.stride() == (21 * 4 * 128, 128, 4 * 128, 1)
        with pytest.raises(Exception, match="view"):
            masked.view(2, 28, 3, 128)
        plain = F.scaled_dot_product_attention(q, k, k)
        assert plain.shape == (2, 4, 21, 128) and plain.device == CUDA


def test_grouped_attention_at_the_7b_heads_on_cuda():
    """attend_masked at Qwen2.5-Math-7B's 28 query / 4 KV heads with bf16 CUDA tensors (fails with `.view`)."""
    with FakeCuda():
        q = torch.empty(3, 28, 5, 128, dtype=torch.bfloat16, device=CUDA)
        k = torch.empty(3, 4, 40, 128, dtype=torch.bfloat16, device=CUDA)
        out = attend_masked(q, k, k, torch.ones(3, 5, 40, dtype=torch.bool, device=CUDA))
        assert out.shape == q.shape and out.device == CUDA and out.dtype == torch.bfloat16


def test_fake_cuda_raises_what_a_gpu_raises():
    with FakeCuda() as cuda:
        x = torch.zeros(6, 4, device=CUDA)
        index = torch.tensor([0, 2], device=CUDA)
        x[index] = torch.ones(2, 4, device=CUDA)  # Python indexing works on fake CUDA tensors
        assert x[index, 1:].shape == (2, 3) and x[index].device == CUDA
        with pytest.raises(Exception, match="cuda:0 and cpu"):
            x + torch.ones(6, 4)  # a CPU tensor in a CUDA computation
        with pytest.raises(TypeError, match="copy it to the host"):
            x.numpy()
        assert x.cpu().numpy().shape == (6, 4) and cuda.syncs == 1  # host reads give zeros, each a sync
        assert x.tolist() == [[0.0] * 4] * 6
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(CaptureError, match="host read"):
            with torch.cuda.graph(graph):
                x.sum().item()
        with pytest.raises(CaptureError, match="copy to the host"):
            with torch.cuda.graph(graph):
                x.cpu()
        with torch.cuda.graph(graph):
            y = x * 2
        graph.replay()
        assert cuda.graph_replays == 1 and y.device == CUDA
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.set_device("cuda:1")
        with pytest.raises(ValueError, match="specified index"):  # as torch.cuda.set_device refuses it on a GPU
            torch.cuda.set_device("cuda")


def test_a_download_waits_for_its_event_alone():
    """`transfer.Download` copies to pinned memory without waiting and waits for its event when read: one
    synchronisation, at the read (a plain `.cpu()` waits at once)."""
    with FakeCuda() as cuda:
        x = torch.zeros(5, 3, device=CUDA)
        pending = Download(x * 2)
        assert cuda.syncs == 0
        y = x + 1  # work queued after the copy: on a GPU the read below does not wait for it
        assert pending.wait().shape == (5, 3) and cuda.syncs == 1 and y.device == CUDA
        with pytest.raises(CaptureError, match="during a CUDA graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                Download(x).wait()


def test_the_memory_log_counts_storages_per_device_and_part_until_freed():
    with FakeCuda(memory_gib=1.0) as cuda:
        with cuda.memory.labelled("weights"):
            w = torch.empty(2**20, dtype=torch.uint8, device=CUDA)
        a = torch.empty(2**18, dtype=torch.float32, device=CUDA)
        view = a[10:]
        del a
        assert cuda.memory.device_live["cuda:0"] == 2 * 2**20  # the view keeps its storage
        assert torch.cuda.mem_get_info(CUDA) == (2**30 - 2 * 2**20, 2**30)
        del view
        gc.collect()
        assert cuda.memory.device_live["cuda:0"] == 2**20 == torch.cuda.memory_allocated(CUDA)
        assert cuda.memory.peak["cuda:0"] == 2 * 2**20
        assert cuda.memory.at_peak["cuda:0"] == {"weights": 2**20, "other": 2**20}
        del w


def test_a_dry_run_of_bon_and_kvrescue_at_the_paper_shapes():
    """Two problems of each method, N = 2, two synthetic steps of 2 tokens, at the paper's caps (512-token steps,
    4,096-token contexts) and budget 64, through `decoding.decode_cell` with CUDA graphs, on fake Qwen2.5-Math-7B,
    1.5B and PRM-7B weights built by the loader's `build_network`."""
    run = dry_run(("bon", "kvrescue"), n=2, batch=2, synthetic=(2, 2))
    assert run.weights == {"base": weight_bytes(PAPER_MODELS["base"]), "helper": weight_bytes(PAPER_MODELS["helper"]),
                           "prm": weight_bytes(PAPER_MODELS["prm"], prm=True)}
    assert run.weights["base"] / 2**30 == pytest.approx(14.19, abs=0.01)  # 7.6B parameters in bf16
    for cell in run.cells:
        assert cell.problems == 2 and cell.steps == 2 * 2
        assert cell.graph_replays > 0  # the base's one-token steps replayed captured graphs
        memory = cell.memory["cuda:0"]
        assert memory["peak_bytes"] >= sum(run.weights.values())
        assert {f"weights.{role}" for role in PAPER_MODELS} | {"engine.bounded", "engine.caches"} <= set(memory["at_peak"])
        assert set(cell.memory) == {"cuda:0", "cpu"} and cell.memory["cpu"]["peak_bytes"] < 2**20  # host metadata only
    bon, kvrescue = run.cells
    # kvrescue holds the helper's full cache as well
    assert kvrescue.memory["cuda:0"]["at_peak"]["engine.caches"] > bon.memory["cuda:0"]["at_peak"]["engine.caches"]
    # The planner counts what the fake device allocated: the weights exactly, the caches (bounded pool, query
    # rings, helper and PRM blocks) within 1 %, and a peak at least as high (its activations are the worst case).
    archs = {role: Architecture.from_config(role, {**shape, "model_type": "qwen2", "torch_dtype": "bfloat16",
                                                   **({"architectures": ["Qwen2ForProcessRewardModel"]}
                                                      if role == "prm" else {})})
             for role, shape in PAPER_MODELS.items()}
    plan = plan_cell(archs, CellShape(batch=2, n=2, base="bounded", budget=64, helper=True, scorer="prm"),
                     DeviceKind(cuda=True, dtype_bytes=2, cuda_graphs=True))
    at_peak = kvrescue.memory["cuda:0"]["at_peak"]
    assert plan.bytes(kind="weights") == sum(run.weights.values())
    assert plan.bytes(kind="kv") == pytest.approx(at_peak["engine.bounded"] + at_peak["engine.caches"], rel=0.01)
    assert kvrescue.memory["cuda:0"]["peak_bytes"] <= plan.total


def cpu_uploads(arrays, device):
    """A mistake to catch: the bounded cache's per-forward index arrays left on the CPU."""
    return upload_all(arrays, torch.device("cpu"))


def test_the_dry_run_catches_a_cache_tensor_on_the_cpu(monkeypatch, qwen2_dir):
    monkeypatch.setattr(bounded, "upload_all", cpu_uploads)
    # The CPU suite cannot see it: on one device every tensor is on the CPU anyway.
    model = load_model(qwen2_dir)
    cache = BoundedCache.for_model(model.net, 16, "rkv", rows=2, max_append=8)
    model.net.prefill(torch.tensor([[5, 6, 7]]), cache, [cache.create()], [3])
    with pytest.raises(Exception, match="cuda:0.*cpu|cpu.*cuda:0"):
        dry_run(("bon",), n=1, batch=1, synthetic=(2, 1), models=SMALL_MODELS)


def test_the_dry_run_catches_a_host_read_inside_a_cuda_graph(monkeypatch):
    """A scalar read in the static step's attention would stop a real capture (cudaStreamCapture refuses it); on the
    CPU the static step runs eagerly and nothing notices."""
    attend = graphs._StaticView.attend

    def reading(self, layer, q, k, v):
        self.lengths.max().item()
        return attend(self, layer, q, k, v)

    monkeypatch.setattr(graphs._StaticView, "attend", reading)
    with pytest.raises(CaptureError, match="during a CUDA graph capture"):  # 2 decode steps: the second is captured
        dry_run(("bon",), n=1, batch=1, synthetic=(3, 1), models=SMALL_MODELS)


@pytest.mark.parametrize("streams", ["1", "0"])
def test_every_capture_on_a_device_warms_up_on_one_stream(monkeypatch, streams):
    """PyTorch keeps a cuBLAS workspace (33 MiB on Hopper) per (handle, stream) and never frees it: a stream made for
    each capture left one more behind each time (issue 41). Two cells, each with graphs of the base and the helper,
    on one fake CUDA device, make one capture stream beside the device's own, and one stream per model role (base,
    PRM; helper), kept from the first cell to the second; none with `KVRESCUE_STREAMS=0`."""
    made = []
    monkeypatch.setenv("KVRESCUE_STREAMS", streams)
    monkeypatch.setattr(graphs, "_CAPTURE_STREAMS", {})
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    init = stream_order.FakeStream.__init__
    monkeypatch.setattr(stream_order.FakeStream, "__init__", lambda stream, *args: made.append(stream) or init(stream, *args))
    run = dry_run(("bon", "kvrescue"), n=2, batch=1, synthetic=(2, 1), models=SMALL_MODELS)
    assert len(made) == (5 if streams == "1" else 2)
    assert all(cell.graph_replays for cell in run.cells)  # graphs captured in both cells, and replayed


def one_row_decoded_in_graphs():
    """A fake 2-layer helper's static steps (`StaticDecode`) over one full-cache row, from 11 to 50 tokens: 1, 2, 3
    then 4 blocks of 16; and the aten ops the last (a replay) dispatched."""
    from kvrescue_testkit.dry_run import fake_model
    from kvrescue.engine.caches import FullCache
    from kvrescue.engine.graphs import StaticDecode
    from kvrescue_testkit.random_checkpoints import build_tokenizer

    tokenizer = build_tokenizer(512)
    with FakeCuda():
        net = fake_model(SMALL, "helper", tokenizer, torch.bfloat16, "cuda:0").net
        cache = FullCache.for_model(net, 512, max_rows=4, max_row_tokens=256, block_size=16)
        step = StaticDecode(net, cache)
        row = cache.create()
        cuda = torch.device("cuda:0")
        with torch.inference_mode():
            net.prefill(upload_all({"prompt": np.zeros((1, 10))}, cuda)["prompt"], cache, [row], [10])
        for _ in range(39):
            step([row], upload_all({"token": np.zeros(1)}, cuda)["token"])
        token = upload_all({"token": np.zeros(1)}, cuda)["token"]
        with Dispatched() as last:
            step([row], token)
    return step, last.ops


def test_the_graphs_of_a_row_bucket_share_one_logits_buffer():
    """Without flash-attn the full cache's step has a graph per row and block bucket: they write one logits buffer
    per row bucket (a 1.5B helper's logits at 512 rows take 155 MB), not one each."""
    step, replayed = one_row_decoded_in_graphs()
    assert sorted(step.steps) == [(1, 1, 1), (1, 2, 1), (1, 4, 1)]  # rows, blocks, tokens a row
    assert len({id(s.logits) for s in step.steps.values()}) == 1
    # a replay hands out that buffer's rows as they are, with no copy of a [rows, vocab] logits a step (the runner
    # copies them into its own buffer at once): the buffer's upload and the tokens' copy into it are its only copies
    assert "clone" not in replayed and replayed.count("copy_") == 2


def test_a_row_bucket_warms_up_once_for_all_its_block_buckets(monkeypatch):
    """The first graph of a row bucket follows a warm-up forward; its wider block tables (the same kernels, the
    attention's over more keys) are captured without one: 3 graphs, 4 forwards dispatched op by op, not 6 (issue
    40)."""
    forwards = []
    forward = graphs.StaticDecode._forward
    monkeypatch.setattr(graphs.StaticDecode, "_forward",
                        lambda step, inputs, tokens=1: forwards.append(1) or forward(step, inputs, tokens))
    step, _ = one_row_decoded_in_graphs()
    assert len(step.steps) == 3 and len(forwards) == 4


def test_full_decodes_its_one_token_steps_in_cuda_graphs():
    """The `full` method's base, on the full cache, decodes through captured graphs on CUDA (as the helper does), as
    the evicted base does."""
    (cell,) = dry_run(("full",), n=2, batch=1, synthetic=(2, 1), models=SMALL_MODELS).cells
    assert cell.graph_replays > 0


@pytest.mark.parametrize("method", ["bon", "kvrescue"])
def test_the_prms_forwards_are_captured_in_cuda_graphs_and_replayed(method, monkeypatch):
    """The PRM scores its candidates (and feeds its committed steps) through static forwards captured in CUDA graphs
    on CUDA, replayed where a bucket comes again; stream order checked throughout (a race raises)."""
    from kvrescue.engine.prm import PRMScorer

    calls = []  # (the static forwards, whether the call replayed a graph captured before it)
    append = graphs.StaticDecode.append

    def recorded(step, rows, token_lists):
        captured = {key for key, s in step.steps.items() if s.graph is not None}
        out = append(step, rows, token_lists)
        calls.append((step, captured and {key for key, s in step.steps.items() if s.graph is not None} == captured))
        return out

    monkeypatch.setattr(graphs.StaticDecode, "append", recorded)
    prm_static = []
    init = PRMScorer.__init__
    monkeypatch.setattr(PRMScorer, "__init__", lambda scorer, *a, **kw: init(scorer, *a, **kw)
                        or prm_static.append(scorer.static))
    dry_run((method,), n=2, batch=2, synthetic=(4, 3), models=SMALL_MODELS)
    assert len(prm_static) == 1 and prm_static[0] is not None
    replayed = [again for step, again in calls if step is prm_static[0]]
    assert replayed and any(replayed)  # captured, and replayed where a bucket came again
    assert any(s.graph is not None for s in prm_static[0].steps.values())


def test_a_forward_of_several_tokens_warms_up_once_per_rows_and_tokens(monkeypatch):
    """A full cache's static forwards of several tokens a row (the PRM's scoring, the commits) capture a graph per
    rows, blocks and tokens bucket, after one warm-up per rows and tokens bucket (its first forward, eager): one row
    appended 3 tokens at a time from 10 to 55 tokens (blocks buckets 1, 2 and 4 of 16 tokens): 3 graphs; then 5
    tokens once: a shape used once is not captured, its one forward is its warm-up. 5 forwards dispatched op by op
    (the graphs' captures included), where warming up and capturing every shape at once took 6 and a capture more."""
    from kvrescue_testkit.dry_run import fake_model
    from kvrescue.engine.caches import FullCache
    from kvrescue_testkit.random_checkpoints import build_tokenizer

    forwards = []
    forward = graphs.StaticDecode._forward
    monkeypatch.setattr(graphs.StaticDecode, "_forward",
                        lambda step, inputs, tokens=1: forwards.append(tokens) or forward(step, inputs, tokens))
    with FakeCuda():
        net = fake_model(SMALL, "helper", build_tokenizer(512), torch.bfloat16, "cuda:0").net
        cache = FullCache.for_model(net, 512, max_rows=4, max_row_tokens=256, block_size=16)
        step = graphs.StaticDecode(net, cache)
        row = cache.create()
        with torch.inference_mode():
            net.prefill(upload_all({"prompt": np.zeros((1, 10))}, torch.device("cuda:0"))["prompt"], cache, [row], [10])
        for _ in range(15):
            step.append([row], [[1, 2, 3]])
        step.append([row], [[1, 2, 3, 4, 5]])
    assert sorted(step.steps) == [(1, 1, 4), (1, 2, 4), (1, 4, 4), (1, 4, 8)]
    assert [key for key, s in sorted(step.steps.items()) if s.graph is not None] == [(1, 1, 4), (1, 2, 4), (1, 4, 4)]
    assert forwards == [4, 4, 4, 4, 8]
