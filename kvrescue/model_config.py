"""A decoder's Hugging Face config.json: found, read and parsed here once, for the engine and for `kvrescue cost`.

No torch here, so `kvrescue cost` stays quick.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kvrescue import hub
from kvrescue.errors import InputError
from kvrescue.files import CONFIG_LIMIT, open_regular, read_regular

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")  # mistral: Llama's decoder (full attention: see `window_error`)
GGUF_HEAD_BYTES = 1 << 20  # a GGUF file's metadata and tensor index sit at its start
BIN_WEIGHTS = "pytorch_model*.bin"  # PyTorch weight files as transformers names them (older Hub repos ship only these)
ZIP_TAIL_BYTES = 1 << 20  # a PyTorch weight file is a zip: its end holds every record's name, size and CRC-32


class ModelConfigError(InputError):
    """A model config that can't be found or read; the message is one line."""


@dataclass
class ModelArgs:
    """Shape and numerics of a decoder, read from a Hugging Face config.json."""

    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    llama3_rope: tuple[float, float, float, int] | None = None  # Llama 3.1's rope_scaling: factor, low and high
    # frequency factors, original context (`rope_frequencies`)
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Args from a config.json dict (Qwen2, Qwen3, Llama and Qwen2 PRM architectures).

        Raises KeyError, TypeError or ValueError for a missing or mangled field; `unsupported` says whether
        the engine can run it.
        """
        dim = _size("hidden_size", cfg["hidden_size"])
        n_heads = _size("num_attention_heads", cfg["num_attention_heads"])
        n_kv_heads = _size("num_key_value_heads", cfg.get("num_key_value_heads") or n_heads)
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads = {n_heads} is not a multiple of num_key_value_heads = {n_kv_heads}")
        params = _object(cfg, "rope_parameters")
        return cls(
            vocab_size=_size("vocab_size", cfg["vocab_size"]),
            dim=dim,
            intermediate_size=_size("intermediate_size", cfg["intermediate_size"]),
            n_layers=_size("num_hidden_layers", cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=_size("head_dim", cfg.get("head_dim") or dim // n_heads),
            rope_theta=_number("rope_theta", cfg.get("rope_theta", params.get("rope_theta", 10000.0)), above=0),
            norm_eps=_number("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), at_least=0),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=cfg.get("model_type") == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            llama3_rope=_llama3_rope(cfg),
        )


def _llama3_rope(cfg: dict[str, Any]) -> tuple[float, float, float, int] | None:
    """Llama 3.1's RoPE scaling parameters (`rope_type` llama3), or None for plain RoPE."""
    scaling = rope_scaling(cfg)
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    low = _number("rope_scaling.low_freq_factor", scaling["low_freq_factor"], above=0)
    return (_number("rope_scaling.factor", scaling["factor"], above=0), low,
            _number("rope_scaling.high_freq_factor", scaling["high_freq_factor"], above=low),
            _size("original_max_position_embeddings", scaling["original_max_position_embeddings"]))


def rope_scaling(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE scaling object (`rope_scaling`, else transformers 5's `rope_parameters`); {} for none."""
    return _object(cfg, "rope_scaling") or _object(cfg, "rope_parameters")


def _object(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """A config field that holds an object: {} when absent or null, else ValueError naming it."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{key} = {value!r}: need an object")
    return value or {}


def _number(key: str, value: Any, *, above: float | None = None, at_least: float | None = None) -> float:
    """A config number field: finite, above `above` or at least `at_least`, else ValueError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and above is not None:
        ok = value > above
    if ok and at_least is not None:
        ok = value >= at_least
    if not ok:
        bound = f"above {above:g}" if above is not None else f"at least {at_least:g}"
        raise ValueError(f"{key} = {value!r}: need a finite number {bound}")
    return float(value)


# Upper bounds of a decoder's sizes: far beyond any released model, low enough that every count `kvrescue cost`
# and the engine derive from them fits 64 bits.
SIZE_LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 22,
               "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
               "head_dim": 1 << 12, "original_max_position_embeddings": 1 << 30}


def _size(key: str, value: Any) -> int:
    """A config size field: an integer from 1 to its `SIZE_LIMITS` bound, else ValueError naming it."""
    limit = SIZE_LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{key} = {value!r}: need an integer from 1 to {limit}")
    return value


def unsupported(cfg: dict[str, Any]) -> str | None:
    """Why the engine can't run a model with this config (another family, scaled RoPE), or None (ValueError for a
    rope_scaling that is no object)."""
    model_type = cfg.get("model_type")
    if model_type == "qwen3_moe":
        return "Qwen3 MoE checkpoints (model_type 'qwen3_moe') are not supported: this engine runs dense qwen2, qwen3 " \
            "and llama decoders"
    if model_type not in FAMILIES:
        return f"unsupported model_type {model_type!r}: this engine runs qwen2, qwen3, llama and mistral checkpoints"
    if model_type != "qwen2" and cfg.get("attention_bias"):  # llama's and qwen3's o_proj then has a bias too
        return "unsupported attention_bias: an o_proj bias is not implemented (qwen2's q/k/v bias is)"
    if cfg.get("use_sliding_window"):
        return "unsupported use_sliding_window: only full attention in every layer is implemented"
    scaling = rope_scaling(cfg)
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", "llama3", None):
        return f"unsupported rope_scaling {scaling}: only plain RoPE and Llama 3.1's llama3 scaling are implemented"
    return None


def window_error(cfg: dict[str, Any], tokens: int) -> str | None:
    """Why a Mistral checkpoint cannot see `tokens` of context in full (its attention is limited to a sliding window
    this engine does not implement), or None: inside its window a sliding window changes nothing."""
    window = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None
    if isinstance(window, int) and not isinstance(window, bool) and tokens > window:
        return (f"its sliding_window of {window} tokens would matter for the {tokens} tokens of context it is given "
                "(this engine implements full attention only)")
    return None


def is_hub_id(model: str) -> bool:
    """Whether a model name that is no local path reads as a Hugging Face Hub id: owner/name, not a relative path."""
    return not model.startswith((".", "/", "~")) and model.count("/") == 1


def load_config(model: str) -> dict[str, Any]:
    """config.json of a local folder, a config.json path, or a Hub model id."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if os.path.lexists(path):
        try:
            data = orjson.loads(read_regular(path, CONFIG_LIMIT, ModelConfigError))
        except orjson.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path}: not a JSON object")
        return data
    if Path(model).suffix == ".gguf":
        raise ModelConfigError(f"{model}: a GGUF file has no config.json; give the original model folder or Hub id")
    if not is_hub_id(model):
        raise ModelConfigError(f"{model}: no such folder or config.json, and not a Hub id (owner/name)")
    try:
        data = hub.config_file(model)[0]
    except hub.HubError as e:
        raise ModelConfigError(f"{model}: {e}; pass a local model folder or config.json instead") from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ModelConfigError(f"{model}: its config.json is not valid JSON ({e})") from None


def model_revision(model: str) -> str | None:
    """The revision recorded in config.json (DESIGN section 8), None when it can't be known.

    A Hub id: the commit its files resolve to (from the local Hugging Face cache when offline; `hub.config_file`). A
    local folder: `sha256:` + the hash of its config.json and weight index (model.safetensors.index.json and every
    safetensors file's name, size and header: tensor names, dtypes, shapes and offsets; every PyTorch weight
    file's name, size and last MiB: its zip directory, each tensor's CRC-32 in it). A GGUF file:
    `sha256:` + the hash of its size and first MiB (metadata and tensor index).
    """
    path = Path(model).expanduser()
    if path.exists():
        try:
            return f"sha256:{_local_digest(path)}"
        except (OSError, struct.error):  # unreadable or truncated files: the loader says what is wrong
            return None
    if not is_hub_id(model):
        return None
    try:
        return hub.config_file(model)[1]
    except hub.HubError:  # offline and not cached, gated, missing: the loader reports it
        return None


def _local_digest(path: Path) -> str:
    """The hash `model_revision` records; special files are an OSError (`files.open_regular`), never read."""
    digest = hashlib.sha256()
    if path.is_dir():
        digest.update(read_regular(path / "config.json", CONFIG_LIMIT, OSError))
        for index in sorted(path.glob("*.safetensors.index.json")):
            digest.update(index.name.encode() + read_regular(index, CONFIG_LIMIT, OSError))
        for weights in sorted(path.glob("*.safetensors")):
            digest.update(weights.name.encode() + struct.pack("<Q", weights.stat().st_size) + _safetensors_header(weights))
        for weights in sorted(path.glob(BIN_WEIGHTS)):
            digest.update(weights.name.encode() + struct.pack("<Q", weights.stat().st_size) + _zip_tail(weights))
    else:
        with open_regular(path, OSError) as f:
            digest.update(struct.pack("<Q", path.stat().st_size) + f.read(GGUF_HEAD_BYTES))
    return digest.hexdigest()


def _zip_tail(path: Path) -> bytes:
    """The last `ZIP_TAIL_BYTES` of a file (a zip's central directory)."""
    with open_regular(path, OSError) as f:
        f.seek(max(0, path.stat().st_size - ZIP_TAIL_BYTES))
        return f.read()


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (its first 8 bytes give its length)."""
    with open_regular(path, OSError) as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return f.read(min(size, 100 << 20))
