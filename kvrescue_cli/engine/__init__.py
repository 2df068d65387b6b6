"""Inference engine: one decoder for base, helper and PRM, KV caches, sampling, step generation, PRM scoring."""

from kvrescue_cli.engine.caches import FullCache, KVCache
from kvrescue_cli.engine.loader import LoadedModel, ModelLoadError, load_model
from kvrescue_cli.engine.prm import PRMScorer
from kvrescue_cli.engine.sampling import SamplingParams, sample
from kvrescue_cli.engine.steps import CandidateStep, append_tokens

__all__ = [
    "FullCache", "KVCache", "LoadedModel", "ModelLoadError", "PRMScorer", "SamplingParams", "CandidateStep",
    "append_tokens", "load_model", "sample",
]
