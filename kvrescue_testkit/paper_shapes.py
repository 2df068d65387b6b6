"""Hugging Face config values (config.json) of the paper's models, for random or fake weights in their shapes
(`benchmarks/gpu_check/gpu_check.py`, `dry_run`), and a small one for quick dry runs: nothing is downloaded."""

from __future__ import annotations

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True)
QWEN25_MATH_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False)
QWEN25_MATH_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)
QWEN25_MATH_PRM_7B = QWEN25_MATH_7B  # the 7B decoder, with the PRM's score head instead of the LM head
PAPER_MODELS = {"base": QWEN25_MATH_7B, "helper": QWEN25_MATH_15B, "prm": QWEN25_MATH_PRM_7B}
# A 2-layer Qwen2 over `random_checkpoints.build_tokenizer(512)`'s vocabulary: dry runs of every role in seconds
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)
SMALL_MODELS = {"base": SMALL, "helper": SMALL, "prm": {**SMALL, "tie_word_embeddings": False}}


def hf_config(shape: dict, tokenizer=None):
    """A transformers Qwen2Config of `shape` (with the tokenizer's EOS and padding ids when given)."""
    from transformers import Qwen2Config

    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) if tokenizer else {}
    return Qwen2Config(**shape, max_position_embeddings=8192, **ids)
