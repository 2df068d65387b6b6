"""Where Ray places a device group's actor: the GPUs its instance is shown, what each actor asks for, the devices
as the actor names them, its threads on a CPU."""

import os

import pytest

from kvrescue.devices import device_groups
from kvrescue.errors import InputError
from kvrescue.ray_placement import actor_devices, actor_resources, cpu_threads, named_gpus


def test_groups_and_what_their_actors_ask_ray_for():
    groups = device_groups(("cuda:1", "cuda:3", "cuda:3", "cpu"))
    assert groups == [("cuda:1",), ("cuda:3",), ("cuda:3",), ("cpu",)]
    assert [actor_resources(groups, g) for g in range(4)] == [
        {"num_cpus": 1, "num_gpus": 1.0}, {"num_cpus": 1, "num_gpus": 0.5}, {"num_cpus": 1, "num_gpus": 0.5},
        {"num_cpus": 1, "num_gpus": 0}]
    assert named_gpus(groups, None) == ["1", "3"]
    assert named_gpus(groups, "4,5,6,7") == ["5", "7"]  # cuda:N counts within what this process sees
    cluster = device_groups(("cuda", "cuda"))  # --ray-address: any GPU of the cluster, one each
    assert actor_resources(cluster, 1) == {"num_cpus": 1, "num_gpus": 1.0} and named_gpus(cluster, None) == []
    with pytest.raises(InputError, match="3 devices do not split into groups of 2"):
        device_groups(("cuda:0", "cuda:1", "cuda:2"), 2)


def test_an_actors_devices_are_its_place_among_the_gpus_ray_assigned_it():
    assert actor_devices(("cpu",), [], None) == ("cpu",)
    assert actor_devices(("cuda:6", "cuda:7"), ["6", "7"], "6,7") == ("cuda:0", "cuda:1")  # Ray's own setting
    assert actor_devices(("cuda:3",), ["7"], "4,5,6,7") == ("cuda:3",)  # a wider CUDA_VISIBLE_DEVICES
    assert actor_devices(("cuda",), [2], None) == ("cuda:2",)  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    with pytest.raises(RuntimeError, match="1 GPU.s. for its 2 ranks"):
        actor_devices(("cuda:0", "cuda:1"), ["0"], "0")


def test_an_actor_on_cpus_computes_on_the_threads_omp_num_threads_names_else_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for named, one_group, two_groups in (("1", 1, 1), ("3", 3, 3), ("", 8, 4), ("0", 8, 4), ("x", 8, 4)):
        monkeypatch.setenv("OMP_NUM_THREADS", named)
        assert (cpu_threads([("cpu",)]), cpu_threads([("cpu",), ("cpu",), ("cuda:0",)])) == (one_group, two_groups)
