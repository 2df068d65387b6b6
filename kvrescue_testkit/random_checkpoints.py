"""Small random Qwen2, Qwen3, Llama and PRM checkpoints written to disk, with a tokenizer built offline.

Tests, the CPU demo and benchmarks use them: each folder holds config.json, model.safetensors and
tokenizer files that both transformers and this engine load. The tokenizer is a byte-level BPE trained
on an embedded text sample, with the Qwen chat tokens, `<extra_0>` and a ChatML chat template; the PRMs of
other families have their family's (random_tokenizers.py).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
    Qwen2ForCausalLM, Qwen2Model, Qwen3Config, Qwen3ForCausalLM,
)

from kvrescue_testkit.random_tokenizers import QWEN2_SPLIT, llama3_tokenizer, mistral_tokenizer, split_byte_level

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<extra_0>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3's generation prompt: with `enable_thinking=False` the assistant turn opens with an empty thought.
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}",
)
SAMPLE_TEXT = """Please reason step by step, and put your final answer within \\boxed{}.

Step 1: Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15.

Step 2: Dividing both sides by 3 gives x = 5.

Step 3: Check: 3 * 5 + 5 = 15 + 5 = 20. The answer is \\boxed{5}.

We compute the sum 1 + 2 + 3 + ... + 10 = 55, and the product 2 * 3 * 7 = 42.
The square root of 144 is 12; the fraction 3/4 equals 0.75 and 7/8 equals 0.875.
If a triangle has sides 3, 4 and 5, it is a right triangle because 9 + 16 = 25.
The probability of rolling two sixes is 1/36. Therefore, the final answer is $\\frac{1}{36}$.
Let f(x) = x^2 - 4x + 4 = (x - 2)^2, so f has a double root at x = 2.
"""


ARCHS = ("qwen2", "qwen3", "llama", "prm", "rlhflow", "math-shepherd", "skywork")


def build_tokenizer(vocab_size: int = 512, chat_template: str = CHAT_TEMPLATE,
                    split: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline on SAMPLE_TEXT, with Qwen's special tokens (`split`: a pre-tokenizer
    pattern, else GPT-2's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = split_byte_level(split) if split else pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def _tokenizer(arch: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """The tokenizer of an `arch` checkpoint (Skywork's: Qwen2.5's pre-tokenizer and a BOS, which its input starts with)."""
    if arch == "rlhflow":
        return llama3_tokenizer(SAMPLE_TEXT, vocab_size)
    if arch == "math-shepherd":
        return mistral_tokenizer(SAMPLE_TEXT, vocab_size)
    if arch == "skywork":  # Qwen2.5's pre-tokenizer, whose merges (".\n") tell its per-part tokenisation apart
        tok = build_tokenizer(vocab_size, split=QWEN2_SPLIT)
        tok.bos_token = "<|endoftext|>"
        return tok
    return build_tokenizer(vocab_size, QWEN3_CHAT_TEMPLATE if arch == "qwen3" else CHAT_TEMPLATE)


def _config(arch: str, vocab_size: int, tok: PreTrainedTokenizerFast, **shape) -> Qwen2Config | Qwen3Config | LlamaConfig:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        initializer_range=shape["init_std"],
        rope_theta=shape["rope_theta"],
        max_position_embeddings=shape["max_positions"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, bos_token_id=tok.pad_token_id)
    if arch == "rlhflow":  # Llama 3.1 8B's layout: an untied LM head, llama3 RoPE scaling (its original context
        # shortened so that every frequency band of the scaling shows within a test's few hundred tokens)
        return LlamaConfig(**common, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": shape["rope_theta"]})
    if arch == "math-shepherd":  # Mistral 7B v0.1's: untied, a sliding window as long as the PRM's window
        return MistralConfig(**common, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                             sliding_window=shape["sliding_window"])
    if arch == "qwen3":  # its own head_dim (Qwen3-0.6B: hidden 1024, 16 heads of 128), no q/k/v bias, tied
        return Qwen3Config(**common, head_dim=shape["head_dim"] or 2 * shape["hidden_size"] // shape["num_heads"],
                           tie_word_embeddings=True, attention_bias=False)
    return Qwen2Config(**common, tie_word_embeddings=False)


def write_random_checkpoint(
    folder: str | Path,
    arch: str = "qwen2",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tokenizer_vocab: int = 512,
    rope_theta: float = 10000.0,
    init_std: float = 0.02,
    head_dim: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    sliding_window: int = 4096,
    max_positions: int = 8192,
) -> Path:
    """Write a random `qwen2` (q/k/v bias, untied), `qwen3` (q/k norms, `head_dim` default twice hidden / heads,
    tied), `llama` (tied embeddings) or PRM checkpoint.

    The PRMs: `prm` is a Qwen2 decoder with the Qwen2ForProcessRewardModel head (`score.0`, `score.2`);
    `rlhflow` a Llama 3.1-like LlamaForCausalLM (untied) with Llama 3's tokenizer and chat template;
    `math-shepherd` a MistralForCausalLM (untied, `sliding_window`) with a Mistral-like tokenizer holding "ки";
    `skywork` a Qwen2ForCausalLM with Skywork's value head `v_head.summary` and a BOS.
    vocab_size defaults to the tokenizer's size and may be larger (as in Qwen2.5). Returns the folder.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, not {arch!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(arch, tokenizer_vocab)
    vocab_size = max(vocab_size or 0, len(tok))
    config = _config(
        arch, vocab_size, tok, hidden_size=hidden_size, intermediate_size=intermediate_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, init_std=init_std, rope_theta=rope_theta, head_dim=head_dim,
        sliding_window=sliding_window, max_positions=max_positions,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        if arch == "prm":
            body = Qwen2Model(config).to(dtype)
            head = torch.nn.Sequential(
                torch.nn.Linear(hidden_size, hidden_size), torch.nn.ReLU(), torch.nn.Linear(hidden_size, 2)
            ).to(dtype)
            tensors = {f"model.{k}": v for k, v in body.state_dict().items()}
            tensors.update({f"score.{k}": v for k, v in head.state_dict().items()})
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, folder / "model.safetensors")
            cfg = config.to_dict()
            cfg["architectures"] = ["Qwen2ForProcessRewardModel"]
            (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        else:
            model = {"llama": LlamaForCausalLM, "rlhflow": LlamaForCausalLM, "math-shepherd": MistralForCausalLM,
                     "qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "skywork": Qwen2ForCausalLM}[arch](config)
            for name, param in model.named_parameters():  # Qwen3's q/k norms start at 1: make each one count
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.data.uniform_(0.5, 1.5)
            model = model.to(dtype)
            model.save_pretrained(folder)
            if arch == "skywork":  # the value head's tensors join the weights, named as Skywork's checkpoints name them
                _add_value_head(folder / "model.safetensors", hidden_size, dtype)
    tok.save_pretrained(folder)
    return folder


def _add_value_head(weights: Path, hidden_size: int, dtype: torch.dtype) -> None:
    """Add `v_head.summary` (Linear(hidden, 1), random) to a saved safetensors file."""
    tensors = load_file(weights)
    head = torch.nn.Linear(hidden_size, 1).to(dtype)
    tensors.update({f"v_head.summary.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, weights, metadata={"format": "pt"})
