"""The CUDA caching allocator's settings for a run: expandable segments unless the user set the allocator's variable,
set before the run's GPU becomes current (so before anything is allocated on it), and recorded in config.json."""

import os

import pytest
import torch
from torch.cuda._utils import _get_device_index

from kvrescue.cuda_allocator import SETTINGS, VARIABLES, allocator_settings, configure_allocator
from kvrescue.group_models import use_device
from kvrescue.outputs import environment
from tests.helpers import unset_allocator_settings


@pytest.fixture()
def unset(monkeypatch):
    unset_allocator_settings(monkeypatch)


def test_expandable_segments_unless_the_user_set_the_allocator(unset, monkeypatch):
    configure_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == SETTINGS == "expandable_segments:True"
    assert torch._C._accelerator_getAllocatorSettings() == SETTINGS  # PyTorch's own record of its settings
    for variable in VARIABLES:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
        monkeypatch.setenv(variable, "max_split_size_mb:512")
        configure_allocator()
        assert os.environ[variable] == "max_split_size_mb:512" and allocator_settings() == "max_split_size_mb:512"
        monkeypatch.setenv(variable, "")


def test_a_gpu_run_configures_the_allocator_before_its_device_becomes_current(unset, monkeypatch):
    """`use_device`, the first thing a run does on its GPU: the allocator is set up first, and `cuda` is read as the
    current GPU (`torch.cuda.set_device` faked with PyTorch's validation, which refuses `cuda` without an index)."""
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.append(
        (_get_device_index(device), os.environ["PYTORCH_CUDA_ALLOC_CONF"])))
    use_device("cuda")
    use_device("cuda:5")
    use_device("cpu")
    assert seen == [(2, SETTINGS), (5, SETTINGS)]


def test_config_json_records_the_allocator_settings_of_a_gpu_run(unset, monkeypatch):
    assert environment(["cuda:0", "cuda:1"])["cuda_allocator"] == SETTINGS
    assert environment(["cpu"])["cuda_allocator"] is None
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert environment(["cuda:0"])["cuda_allocator"] == "expandable_segments:False"
