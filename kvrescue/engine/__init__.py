"""Inference engine: one decoder for base, helper and PRM, KV caches, sampling, step generation, PRM scoring."""

from kvrescue.engine.caches import FullCache, KVCache
from kvrescue.engine.loader import LoadedModel, ModelLoadError, load_model
from kvrescue.engine.prm import PRMScorer
from kvrescue.engine.sampling import SamplingParams, sample
from kvrescue.engine.steps import CandidateStep, append_tokens

__all__ = [
    "FullCache", "KVCache", "LoadedModel", "ModelLoadError", "PRMScorer", "SamplingParams", "CandidateStep",
    "append_tokens", "load_model", "sample",
]
