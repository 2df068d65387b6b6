"""Every process computes on the device it was given (`--devices cuda:N`), checked with faked visible GPUs: in
this process, the ranks of a `--tp` group, and Ray actors (whose CUDA_VISIBLE_DEVICES Ray sets, so that their
device numbers are relative to the GPUs Ray assigned them)."""

from pathlib import Path

import pytest
import torch

from kvrescue import device_plan, group_models, in_process, rank_group
from kvrescue.devices import device_groups
from kvrescue.errors import InputError
from kvrescue.grid import GridOptions
from tests.helpers import small_grid, unset_allocator_settings
from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from kvrescue.search import SearchSettings
from kvrescue.ray_placement import actor_devices, actor_resources
from kvrescue.workers import RayWorkers

GiB = 2**30


@pytest.fixture()
def gpus(monkeypatch) -> list[tuple[str, str]]:
    """Eight faked GPUs, each with 1 MiB free (so the memory check refuses before any weights are read); the
    (call, device) of every current-device and free-memory call."""
    calls = []
    unset_allocator_settings(monkeypatch)  # use_device sets them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))

    def mem_get_info(device=None):
        calls.append(("mem_get_info", str(device)))
        return 2**20, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return calls


def options(models: dict[str, str], devices: tuple[str, ...], tp: int, out: Path) -> GridOptions:
    return small_grid(out, SearchSettings(batch=2), models=models, devices=devices, tp=tp)


@pytest.fixture(scope="module")
def models(tmp_path_factory, prm_dir) -> dict[str, str]:
    """A base whose 4 KV heads --tp 4 splits, and the PRM."""
    base = write_random_checkpoint(tmp_path_factory.mktemp("base"), "qwen2", num_heads=4, num_kv_heads=4, seed=7,
                                   hidden_size=64, num_layers=2, intermediate_size=128)
    return {"base": str(base), "helper": str(base), "prm": str(prm_dir)}


def test_one_device_in_this_process_is_the_named_one(gpus, models, tmp_path):
    with pytest.raises(InputError, match="GiB is free"):
        in_process.InProcessGroup(options(models, ("cuda:1",), 1, tmp_path), ("cuda:1",))
    assert gpus and {device for _, device in gpus} == {"cuda:1"}
    assert ("set_device", "cuda:1") in gpus and ("mem_get_info", "cuda:1") in gpus


def test_each_rank_of_a_tp_group_computes_on_its_named_device(gpus, models, monkeypatch, tmp_path):
    """`--devices cuda:4,cuda:5,cuda:6,cuda:7 --tp 4`: rank r starts on the r-th named GPU (the processes'
    start and the process group are faked here), and each rank's memory check reads that GPU."""
    started, joined = [], []
    monkeypatch.setattr(rank_group.subprocess, "Popen", lambda argv, **kw: started.append(argv))
    monkeypatch.setattr(rank_group, "join", lambda rendezvous, rank, world, device: joined.append((rank, device)))
    group = ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    grid = options(models, group, 4, tmp_path)
    leader = rank_group.RankGroup(grid, group)
    try:
        assert joined == [(0, "cuda:4")]
        assert [argv[argv.index("kvrescue.rank_follower") + 1:][1:3] for argv in started] == [
            ["1", "cuda:5"], ["2", "cuda:6"], ["3", "cuda:7"]]
    finally:
        rank_group.shutil.rmtree(leader.folder)
    gpus.clear()
    with pytest.raises(InputError, match="GiB is free"):
        device_plan.wait_for_room(grid.group_plan(), group)  # rank 0's check of every rank's device, before the group forms
    assert {d for _, d in gpus} == set(group) and all(("mem_get_info", device) in gpus for device in group)
    for device in group:
        gpus.clear()
        group_models.use_device(device)  # what each rank's load_roles does first, on the device it was started with
        assert gpus == [("set_device", device)]


def test_tp_groups_sharing_gpus_are_a_one_line_error_before_any_actor(models, tmp_path):
    """Ray would give each actor one GPU (num_gpus 2 / 2 shares), and its second rank none."""
    with pytest.raises(InputError, match="the group cuda:0,cuda:1 shares its GPUs with another group; groups of "
                                         "--tp 2 need GPUs of their own"):
        RayWorkers(options(models, ("cuda:0", "cuda:1", "cuda:0", "cuda:1"), 2, tmp_path), print)


def test_ray_actors_of_tp_groups_get_disjoint_gpus_named_from_zero(models, monkeypatch, tmp_path):
    """A private Ray instance over four faked GPUs of the eight this process sees (CUDA_VISIBLE_DEVICES 4..7 of
    the machine): each of two `--tp 2` actors sees the two Ray assigned it as cuda:0 and cuda:1."""
    import ray

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13,14,15,16,17")
    grid = options(models, ("cuda:4", "cuda:5", "cuda:6", "cuda:7"), 2, tmp_path)
    workers = RayWorkers(grid, print)
    workers._init()
    try:
        @ray.remote
        class Probe:
            def devices(self, group):
                import os

                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                return actor_devices(group, ray.get_gpu_ids(), visible), visible

        groups = device_groups(grid.devices, grid.tp)
        seen = ray.get([Probe.options(**actor_resources(groups, g)).remote().devices.remote(groups[g])
                        for g in range(len(groups))])
    finally:
        ray.shutdown()
    assert [devices for devices, _ in seen] == [("cuda:0", "cuda:1")] * 2
    assigned = [set(visible.split(",")) for _, visible in seen]
    assert assigned[0] | assigned[1] == {"14", "15", "16", "17"} and not assigned[0] & assigned[1]
