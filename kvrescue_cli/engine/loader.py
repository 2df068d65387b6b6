"""Load Qwen2/Llama/PRM checkpoints into the engine: local folders, Hub ids, or GGUF files."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvrescue_cli.engine.model import CausalLM, ModelArgs, ProcessRewardModel, Transformer, hf_to_engine_state_dict

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched or understood; the message says which and why."""


@dataclass
class LoadedModel:
    """An engine network with its tokenizer and Hugging Face config."""

    net: Transformer
    tokenizer: Any
    config: dict[str, Any]
    name: str
    eos_ids: list[int] = field(default_factory=list)

    @property
    def args(self) -> ModelArgs:
        return self.net.args

    @property
    def is_prm(self) -> bool:
        return isinstance(self.net, ProcessRewardModel)

    @property
    def device(self) -> torch.device:
        return self.net.decoder.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.decoder.tok_embeddings.weight.dtype

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward, no cache: LongTensor [B, T] -> float32 [B, T, vocab] (a PRM: [B, T, 2])."""
        return self.net(input_ids.to(self.device)).float()


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    """Load a local folder (config.json + safetensors + tokenizer), a GGUF file, or a Hugging Face Hub id."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    p = Path(path).expanduser()
    if p.is_dir():
        return _load_folder(p, torch_dtype, device, str(path))
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, torch_dtype, device)
    if p.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise ModelLoadError(f"model {path!r}: not a folder with config.json, a .gguf file, or a Hub id (owner/name)")
    return _load_folder(_hub_download(str(path)), torch_dtype, device, str(path))


def _hub_download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))
    except GatedRepoError:
        raise ModelLoadError(f"model {repo_id!r}: gated on the Hugging Face Hub; accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model {repo_id!r}: not found on the Hugging Face Hub (or private without a token)") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id!r}: not in the local Hugging Face cache and the Hub is unreachable from this machine; "
            "download it where there is network access and pass the folder"
        ) from None
    except Exception as e:  # network stacks raise many types; keep the message to one line
        raise ModelLoadError(f"model {repo_id!r}: download from the Hugging Face Hub failed: {type(e).__name__}: {e}".splitlines()[0]) from None


def _eos_ids(cfg: dict[str, Any], gen_cfg: dict[str, Any], tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for v in (gen_cfg.get("eos_token_id"), cfg.get("eos_token_id"), tokenizer.eos_token_id):
        for i in v if isinstance(v, list) else [v]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


def _build(sd: dict[str, torch.Tensor], cfg: dict[str, Any], dtype: torch.dtype, device: str) -> Transformer:
    args = ModelArgs.from_hf(cfg)
    is_prm = "score.0.weight" in sd or any("ProcessRewardModel" in a for a in cfg.get("architectures") or [])
    if is_prm and "score.0.weight" not in sd:
        raise ModelLoadError("checkpoint declares a process reward model but has no score.0/score.2 head weights")
    with torch.device("meta"):
        net: Transformer = ProcessRewardModel(args) if is_prm else CausalLM(args)
    net.load_state_dict(hf_to_engine_state_dict(sd, args), assign=True)
    if isinstance(net, CausalLM):
        net.tie_weights()
    return net.to(device=device, dtype=dtype).eval()


def _load_folder(folder: Path, dtype: torch.dtype, device: str, name: str) -> LoadedModel:
    from transformers import AutoTokenizer

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"model {name!r}: {folder} has no config.json")
    cfg = json.loads(cfg_path.read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model {name!r}: {folder} has no .safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    net = _build(sd, cfg, dtype, device)
    del sd
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gen_path = folder / "generation_config.json"
    gen_cfg = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return LoadedModel(net, tokenizer, cfg, name, _eos_ids(cfg, gen_cfg, tokenizer))


def _load_gguf(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    """Dequantise a GGUF file through transformers' GGUF loader, then map its weights into the engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    net = _build(dict(hf.state_dict()), cfg, dtype, device)
    gen_cfg = hf.generation_config.to_dict()
    del hf
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return LoadedModel(net, tokenizer, cfg, str(path), _eos_ids(cfg, gen_cfg, tokenizer))
