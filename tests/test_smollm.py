"""The real SmolLM2-135M-Instruct GGUF, through the real GGUF loading path, equals transformers."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrescue.engine import FullCache, load_model
from kvrescue.smollm import smollm2_folder, smollm2_gguf


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_gguf_matches_transformers() -> None:
    ours = load_model(smollm2_gguf())  # dequantised by transformers' GGUF loader, mapped into the engine
    ref = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is 12 * 7? Reason step by step."}]
    prompt = ours.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([ours.tokenizer.encode(prompt) + ours.tokenizer.encode("Step 1: 12 * 7 = 84.\n\nSo")])
    expected = ref(ids).logits[0]
    assert (ours.logits(ids)[0] - expected).abs().max() < 1e-4
    n = ids.shape[1] - 8
    cache = FullCache.for_model(ours.net, 1024, max_rows=2)
    row = cache.create()
    out = ours.net.prefill(ids[:, :n], cache, [row], [n], last_only=False)[0]
    assert (out - expected[:n]).abs().max() < 1e-4
    for t in range(n, ids.shape[1]):
        step = ours.net.decode(ids[:, t], cache, [row])[0]
        assert (step - expected[t]).abs().max() < 1e-4
    assert ours.eos_ids == [ours.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_a_folder_another_process_converted_meanwhile_is_taken(monkeypatch, tmp_path, llama_dir) -> None:
    """Two first runs convert at once: the one whose rename loses to the other's finished folder uses that folder
    (it did crash with "Directory not empty"). The conversion reads a random Llama checkpoint in the GGUF's place."""
    import transformers

    from kvrescue import smollm

    monkeypatch.setenv("KVRESCUE_CACHE", str(tmp_path))
    folder = tmp_path / "SmolLM2-135M-Instruct"

    def the_other_process_finishes_first() -> Path:
        shutil.copytree(llama_dir, folder)
        return llama_dir / "model.gguf"

    monkeypatch.setattr(smollm, "smollm2_gguf", the_other_process_finishes_first)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = auto.from_pretrained.__func__
        monkeypatch.setattr(auto, "from_pretrained",
                            classmethod(lambda cls, path, gguf_file=None, real=real, **kw: real(cls, path, **kw)))
    assert smollm.smollm2_folder() == folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # the loser's temporary folder is gone
