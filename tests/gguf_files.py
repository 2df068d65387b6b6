"""GGUF files written from random checkpoints as llama.cpp's convert_hf_to_gguf.py writes them: f32 tensors named by
gguf-py's table, the hyperparameters (a Qwen3's head size as `attention.key_length`) and the byte-level BPE tokenizer
(vocabulary, merges, control tokens, chat template) as metadata."""

import json
from pathlib import Path

import gguf
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

ARCHS = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def write_gguf(folder: Path, out: Path) -> Path:
    """Write the qwen2 or qwen3 checkpoint in `folder` (random_checkpoints') as the GGUF file `out`."""
    cfg, tok = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    arch = ARCHS[cfg.model_type]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(folder.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.model_type == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = {i: t for t, i in tok.get_vocab().items()}
    writer.add_tokenizer_model("gpt2")
    # How the folder's tokenizer splits text as transformers reads it: Qwen2's pattern for a qwen2 model, else the
    # tokenizer.json's (random_checkpoints': GPT-2's)
    writer.add_tokenizer_pre("qwen2" if type(tok).__name__ == "Qwen2Tokenizer" else "gpt-2")
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(cfg.vocab_size)])
    control = {i for i, added in tok.added_tokens_decoder.items() if added.special}
    writer.add_token_types([gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL
                            for i in range(cfg.vocab_size)])
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in load_file(folder / "model.safetensors").items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
