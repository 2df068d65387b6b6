"""A device group's models: every role the grid's cells load on this engine (`cell_plan.GroupPlan`), loaded once on
one device, with one-line errors before any weights are read."""

from __future__ import annotations

from typing import Any

import torch

import kvrescue.engine.invariance as invariance
from kvrescue import hub
from kvrescue.cell_plan import GroupPlan
from kvrescue.cost import Architecture
from kvrescue.cuda_allocator import configure_allocator
from kvrescue.devices import is_cpu, is_gpu
from kvrescue.engine.loader import LoadedModel, ModelLoadError, load_model
from kvrescue.engine.prm import check_prm
from kvrescue.engine.prm_recipes import get_recipe
from kvrescue.errors import InputError
from kvrescue.model_config import ModelConfigError, window_error

CPU_PARAMS = 3e9  # larger models are refused on a CPU: hours per problem, and tens of GB in fp32


def refuse_large_on_cpu(role: str, name: str) -> None:
    """A one-line error, before any weights are read, for a model too large to decode on a CPU."""
    try:
        params = Architecture.of_model(name).params
    except ModelConfigError:  # no usable config: the loader says why
        return
    if params > CPU_PARAMS:
        raise InputError(f"{role} model {name} has {params / 1e9:.1f}B parameters, too many for a CPU run; "
                         "use --device cuda, --preset cpu-demo, or smaller local models with --base/--helper/--prm")


def check_policy_tokenizers(tokenizers: dict[str, Any]) -> None:
    """Base and helper (by role) must share a tokenizer: KV-Rescue commits the same tokens to both."""
    policy = [tokenizers[r] for r in ("base", "helper") if r in tokenizers]
    if len(policy) == 2 and policy[0].get_vocab() != policy[1].get_vocab():
        raise InputError("base and helper tokenizers differ; KV-Rescue commits the same tokens to both models")


def indexed_gpu(device: str) -> str:
    """`cuda` read as this process's current GPU (`cuda:N`): `torch.cuda.set_device` and CUDA graphs need an index."""
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device


def use_device(device: str) -> None:
    """Make a GPU this process's current device (streams, graphs, NCCL and every default-device call use it, not
    cuda:0), its allocator configured for the run before anything is allocated."""
    if is_gpu(device):
        configure_allocator()
        torch.cuda.set_device(indexed_gpu(device))


def load_roles(group: GroupPlan, device: str) -> dict[str, LoadedModel]:
    """Every model the group's cells load on this engine, loaded once on `device`; base and helper must share a
    tokenizer."""
    loaded: dict[str, LoadedModel] = {}
    by_name: dict[str, LoadedModel] = {}
    models, engine = group.models, group.engine
    hub.pin(models.hub_revisions())  # this process may be a Ray worker or a --tp rank
    use_device(device)
    if engine.deterministic and is_gpu(device):
        invariance.prepare_cuda(device)  # before this process's first matrix product
    for role, name in group.native_models().items():
        if is_cpu(device):
            refuse_large_on_cpu(role, name)
        try:
            if name not in by_name:
                by_name[name] = load_model(name, engine.dtype, device, tp=group.placement.tp,
                                           exact_heads=role == "base")
        except ModelLoadError as err:
            raise InputError(f"{role} model: {err}; on a CPU without the Hub try --preset cpu-demo, "
                             "or give local folders with --base/--helper/--prm") from None
        loaded[role] = by_name[name]
        reason = role != "prm" and window_error(loaded[role].config, group.settings.context_cap)
        if reason:
            raise InputError(f"{role} model {name}: {reason}")
    if "prm" in loaded:
        try:
            check_prm(loaded["prm"], get_recipe(models.prm_recipe, models.prm_format))
        except ValueError as err:
            raise InputError(f"--prm: {err}") from None
    check_policy_tokenizers({role: model.tokenizer for role, model in loaded.items()})
    return loaded
