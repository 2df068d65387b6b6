"""Inference engine: one decoder for base, helper and PRM, KV caches, sampling, step generation."""

from kvrescue_cli.engine.caches import FullCache, KVCache
from kvrescue_cli.engine.loader import LoadedModel, ModelLoadError, load_model

__all__ = ["FullCache", "KVCache", "LoadedModel", "ModelLoadError", "load_model"]
