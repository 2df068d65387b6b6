"""Offline tokenizers of the Llama 3.1 and Mistral families for the random PRM checkpoints (random_checkpoints.py).

Each is a BPE trained on the embedded sample with its family's pre-tokenizer and special tokens:
- `llama3_tokenizer`: byte-level with Llama 3's split pattern, the header tokens and a Llama-3.1-like chat
  template (the system block with its dates, contents trimmed), as RLHFlow's PRM renders its conversations;
- `mistral_tokenizer`: SentencePiece-style (word starts marked "▁", a word start added at the text's start, BOS
  added by `encode`), with "ки" as a token, as Math-Shepherd's PRM takes its step tag.
"""

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Llama 3's pre-tokenizer pattern (its tokenizer.json): a run of newlines is one piece, a space joins the word after.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2.5's (its tokenizer.json): as Llama 3's, with digits one at a time.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3.1 Instruct's template without its tool calls: a system block first, each turn's content trimmed.
LLAMA31_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>"]
STEP_TAG = "ки"


def split_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    """A byte-level pre-tokenizer splitting by `pattern` (Llama 3's and Qwen2's form)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _train(tok: Tokenizer, sample: str, vocab_size: int, special: list[str], **trainer) -> None:
    tok.train_from_iterator([sample] * 4, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False, **trainer))


def llama3_tokenizer(sample: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A Llama-3.1-like byte-level BPE with the chat header tokens and template; `encode` adds no BOS (the template
    writes it)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = split_byte_level(LLAMA3_SPLIT)
    tok.decoder = decoders.ByteLevel()
    _train(tok, sample, vocab_size, LLAMA3_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|end_of_text|>", chat_template=LLAMA31_CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def mistral_tokenizer(sample: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A Mistral-like SentencePiece-style BPE with "ки" as a token; `encode` adds BOS."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    _train(tok, sample, vocab_size, MISTRAL_SPECIAL, initial_alphabet=list(string.printable.strip() + "\n"))
    tok.add_tokens([AddedToken(STEP_TAG, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", clean_up_tokenization_spaces=False)
