"""The fake CUDA device's stream order (`kvrescue_testkit.stream_order`, as PyTorch's CUDA Sanitizer): small
hand-written races raise, naming both streams and operations; the same programs with their waits do not; and the
engine's cells run on a stream per model without a race, while deleting one of its waits is caught."""

import gc

import pytest
import torch

from benchmarks.gpu_check.gpu_check_problems import synthetic_grid
from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue.engine import streams as model_streams
from kvrescue.engine.caches import FullCache
from kvrescue.engine.runner import Runner
from kvrescue.engine.streams import ModelStream
from kvrescue.engine.transfer import Download
from kvrescue.cell_plan import Cell
from kvrescue.search import Controller
from kvrescue_testkit.dry_run import TokenScript, dry_run, fake_model
from kvrescue_testkit.fake_cuda import FakeCuda
from kvrescue_testkit.paper_shapes import SMALL, SMALL_MODELS
from kvrescue_testkit.random_checkpoints import build_tokenizer
from kvrescue_testkit.stream_order import StreamRace

CUDA = torch.device("cuda:0")


def test_a_read_on_another_stream_without_a_wait_raises():
    with FakeCuda(), pytest.raises(StreamRace, match=r"aten.add.Tensor on stream 1 reads .* that "
                                                     r"aten.fill_.Scalar wrote on the default stream"):
        x = torch.empty(4, device=CUDA)
        x.fill_(1.0)
        with torch.cuda.stream(torch.cuda.Stream()):
            x + 1


def test_a_write_over_another_streams_read_without_a_wait_raises():
    with FakeCuda():
        x = torch.zeros(4, device=CUDA)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        with pytest.raises(StreamRace, match=r"aten.fill_.Scalar on the default stream writes .* that aten.mul.Tensor "
                                             r"read on stream 1"):
            x.fill_(3.0)
        assert y.shape == (4,)


def test_an_event_orders_only_what_came_before_it():
    with FakeCuda():
        x = torch.zeros(4, device=CUDA)
        side = torch.cuda.Stream()
        early = torch.cuda.Event()
        early.record()
        x.add_(1)
        side.wait_event(early)
        with torch.cuda.stream(side), pytest.raises(StreamRace, match="aten.add_.Tensor wrote on the default stream"):
            x * 2
        late = torch.cuda.current_stream().record_event()
        side.wait_event(late)
        with torch.cuda.stream(side):
            x * 2  # ordered now


def test_waits_stream_waits_and_host_waits_order_the_streams():
    with FakeCuda():
        one, two = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(one):
            x = torch.ones(4, device=CUDA)
        two.wait_stream(one)
        with torch.cuda.stream(two):
            x.add_(1)
        event = torch.cuda.Event()
        event.record(two)
        event.synchronize()  # the host waited: what it launches next, on any stream, comes after
        with torch.cuda.stream(one):
            x.mul_(2)
        torch.cuda.synchronize()
        with torch.cuda.stream(two):
            assert (x - 1).shape == (4,)
            x.view(2, 2).shape  # a view reads nothing
            torch.empty_like(x)  # nor does a factory


def test_a_storage_freed_while_another_stream_may_use_it_raises_at_the_next_operation():
    with FakeCuda():
        x = torch.zeros(4, device=CUDA)  # on the default stream: its block goes back to the default stream's pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        del x
        gc.collect()
        with pytest.raises(StreamRace, match=r"allocated on the default stream, was freed while aten.add_.Tensor "
                                             r"on stream 1 may still use it"):
            torch.zeros(4, device=CUDA)


@pytest.mark.parametrize("keep", ["wait", "record_stream"])
def test_a_storage_freed_after_a_wait_or_recorded_for_its_stream_does_not(keep):
    with FakeCuda():
        x = torch.zeros(4, device=CUDA)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        if keep == "wait":
            torch.cuda.current_stream().wait_stream(side)
        else:
            x.record_stream(side)
        del x
        gc.collect()
        torch.zeros(4, device=CUDA)


def test_the_host_reads_a_nonblocking_copy_only_after_waiting_for_it():
    with FakeCuda():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = torch.zeros(3, device=CUDA)
            host = x.to("cpu", non_blocking=True)
            with pytest.raises(StreamRace, match=r"the host reads \(Tensor.numpy\) .* aten._to_copy.default on "
                                                 r"stream 1 copies there"):
                host.numpy()
            assert Download(x).wait().shape == (3,)  # its event waited for
            x.cpu().numpy()  # a blocking copy waits itself


def test_a_graph_replay_reads_what_its_capture_read():
    with FakeCuda():
        x = torch.zeros(4, device=CUDA)
        out = torch.zeros(4, device=CUDA)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(x * 2)
        writer, replayer = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(writer):
            x.fill_(1.0)
        with torch.cuda.stream(replayer), pytest.raises(StreamRace, match="CUDAGraph.replay on stream 3 reads"):
            graph.replay()
        replayer.wait_stream(writer)
        with torch.cuda.stream(replayer):
            graph.replay()


def test_a_model_stream_is_made_once_per_role_and_follows_the_default_stream(monkeypatch):
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    with FakeCuda():
        base = ModelStream.of(CUDA, "base")
        assert base.stream is ModelStream.of(CUDA, "base").stream is not ModelStream.of(CUDA, "helper").stream
        weights = torch.ones(4, device=CUDA)
        with base.on(), pytest.raises(StreamRace, match="reads"):
            weights * 2
        base.follow()
        with base.on():
            weights * 2
        monkeypatch.setenv("KVRESCUE_STREAMS", "0")
        assert ModelStream.of(CUDA, "prm").stream is None
    assert ModelStream.of(torch.device("cpu"), "base").stream is None


def test_cells_of_bon_kvrescue_and_full_run_each_model_on_its_own_stream_without_a_race(monkeypatch):
    """Each of the base, helper and PRM launches its kernels on its own stream (the default stream makes the caches);
    the stream order finds no race in cells of bon, kvrescue and full."""
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    kernels = []  # per cell: kernels run on each role's stream by the cell's end

    def join_all():
        model_streams.join_all()
        order = torch.cuda.current_stream().order
        kernels.append({role: order.kernels[stream.name] for (_, _, role), stream in model_streams._STREAMS.items()})

    monkeypatch.setattr("kvrescue.decoding.join_all", join_all)
    run = dry_run(("bon", "kvrescue", "full"), n=2, batch=2, synthetic=(2, 2), models=SMALL_MODELS)
    assert [c.steps for c in run.cells] == [4, 4, 4]
    bon, kvrescue, full = [{role: n - before.get(role, 0) for role, n in after.items()}
                           for before, after in zip([{}] + kernels, kernels)]
    assert bon["base"] and bon["prm"] and "helper" not in bon
    assert kvrescue["base"] and kvrescue["helper"] and kvrescue["prm"]
    assert full["base"] and full["prm"] and not full["helper"]


def test_without_the_model_streams_wait_for_the_default_stream_a_cell_races(monkeypatch):
    """The caches are made on the default stream; a model stream that does not wait for it (`follow`) races them."""
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    monkeypatch.setattr(ModelStream, "follow", lambda stream: None)
    with pytest.raises(StreamRace, match="on the default stream, with no wait between them"):
        dry_run(("bon",), n=2, batch=1, synthetic=(2, 1), models=SMALL_MODELS)


@pytest.mark.parametrize("joined", [True, False])
def test_a_cache_is_freed_after_the_default_stream_waits_for_the_model_streams(monkeypatch, joined):
    """A runner's prefill writes its cache (made on the default stream) on the base's stream and nothing waits for
    it on the host: freeing the cache then races the prefill unless the default stream waited (`join_all`, at the
    end of every cell: a cell that raises mid-forward ends so)."""
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    tokenizer = build_tokenizer(512)
    with FakeCuda():
        model = fake_model(SMALL, "base", tokenizer, torch.bfloat16, "cuda:0")
        cache = FullCache.for_model(model.net, 256, max_rows=4, max_row_tokens=128)
        runner = Runner(model, cache, stream=ModelStream.of(model.device, "base"))
        runner.prefill([[5, 6, 7]])
        if joined:
            model_streams.join_all()
        del runner, cache
        gc.collect()
        if joined:
            torch.zeros(1, device=CUDA)
        else:
            with pytest.raises(StreamRace, match="allocated on the default stream, was freed while .* on stream 1"):
                torch.zeros(1, device=CUDA)


@pytest.mark.parametrize("joined", [True, False])
def test_a_cell_that_fails_mid_step_frees_its_caches_after_the_model_streams(monkeypatch, joined):
    """A cell that raises after a commit's forward was launched (on the base's stream, writing the cache made on the
    default stream) and before any host wait: `decode_cell` ends with the default stream waiting for the model
    streams (`join_all`), so freeing the cell's caches is not a race; without that wait it is."""
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    opened = []
    open_steps = Controller._open_steps

    def failing(controller, problems):
        if opened:
            raise RuntimeError("a failure after the first commit")
        opened.append(problems)
        open_steps(controller, problems)

    monkeypatch.setattr(Controller, "_open_steps", failing)
    if not joined:
        monkeypatch.setattr("kvrescue.decoding.join_all", lambda: None)
    tokenizer = build_tokenizer(512)
    with FakeCuda(host_reads=TokenScript(tokenizer.encode(" x", add_special_tokens=False)[0])):
        models = {role: fake_model(shape, role, tokenizer, torch.bfloat16, "cuda:0")
                  for role, shape in SMALL_MODELS.items()}
        options, problems = synthetic_grid(dict(n=2, budget=16, synthetic=(2, 2), batch=1), "cuda:0", torch.bfloat16, 1)
        cell = Cell(problems, "bon", 16, 2, 0)

        def decode() -> None:
            plan = options.plan_of(cell)
            engine = build_cell(plan, models)
            try:
                decode_cell(plan, cell, engine, iter(problems.problems), lambda trace, _: None)
            finally:
                del engine

        with pytest.raises(RuntimeError, match="after the first commit"):
            decode()
        gc.collect()
        if joined:
            torch.zeros(1, device=CUDA)
        else:
            with pytest.raises(StreamRace, match="allocated on the default stream, was freed while"):
                torch.zeros(1, device=CUDA)
