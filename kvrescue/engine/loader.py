"""Load Qwen2/Qwen3/Llama/Mistral/PRM checkpoints into the engine: local folders, Hub ids, or GGUF files."""

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from kvrescue import hub
from kvrescue.devices import is_gpu
from kvrescue.dtypes import NAMES
from kvrescue.engine.gguf_bounds import GGUFBoundsError, check_gguf_header
from kvrescue.engine.model import (
    VALUE_HEAD, CausalLM, ProcessRewardModel, Transformer, ValueHeadModel, hf_to_engine_state_dict,
)
from kvrescue.engine.tp import Shard, make_shard, shard_weight
from kvrescue.files import CONFIG_LIMIT, check_regular, read_regular
from kvrescue.model_config import BIN_WEIGHTS, ModelArgs, is_hub_id, unsupported
from kvrescue.shapes import shard_degree

DTYPES = {name: getattr(torch, dtype) for name, dtype in NAMES.items()}  # the --dtype names as torch dtypes
QWEN3_HEAD_DIM = "qwen3.attention.key_length"  # a GGUF key transformers does not read (_gguf_config_fixes)


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that multiply bf16 matrices natively


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bf16 matrix multiplies (AVX512-BF16 or AMX), read from /proc/cpuinfo's flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: assume not
            return False
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32; any other name as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if is_gpu(device) or cpu_has_native_bf16() else "float32"


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
    def head_kind(self) -> str:
        """The head it carries (prm_recipes.HEADS): classes (score.0/score.2), value (v_head) or lm."""
        return {ProcessRewardModel: "classes", ValueHeadModel: "value"}.get(type(self.net), "lm")

    @property
    def device(self) -> torch.device:
        return self.net.decoder.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.decoder.tok_embeddings.weight.dtype

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward, no cache: LongTensor [B, T] -> float32 [B, T, vocab] (a PRM: [B, T, 2]; a value
        head: [B, T, 1])."""
        return self.net(input_ids.to(self.device)).float()


def load_model(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu", *, tp: int = 1, exact_heads: bool = False
) -> LoadedModel:
    """Load a local folder (config.json + safetensors + tokenizer), a GGUF file, or a Hugging Face Hub id.

    With tp = K > 1 this rank reads only its shard of the weights (tp.py says how each model is split).
    """
    if tp > 1 and not (dist.is_initialized() and dist.get_world_size() == tp):
        raise ModelLoadError(f"model {path!r}: --tp {tp} needs torch.distributed initialised with {tp} ranks")
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    place = dict(dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype, device=device, tp=tp, exact_heads=exact_heads)
    p = Path(path).expanduser()
    if p.suffix == ".gguf" and p.exists() and not p.is_dir():
        return _load_gguf(p, **place)
    return _load_folder(model_folder(path), str(path), **place)


def model_folder(path: str | Path) -> Path:
    """The local folder of a model folder or Hub id (downloaded, or read from the Hugging Face cache)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists() or not is_hub_id(str(path)):
        raise ModelLoadError(f"model {path!r}: not a folder with config.json, a .gguf file, or a Hub id (owner/name)")
    return _hub_download(str(path))


def load_tokenizer(path: str | Path) -> tuple[Any, list[int]]:
    """A model's tokenizer and EOS ids, as `load_model` reads them, without its weights (folder or Hub id)."""
    folder = model_folder(path)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"model {str(path)!r}: {folder} has no config.json")
    _check_files(folder, str(path))
    return _tokenizer(folder, str(path), _read_json(cfg_path, str(path)))


def _tokenizer(folder: Path, name: str, cfg: dict[str, Any]) -> tuple[Any, list[int]]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # transformers and tokenizers raise many kinds for a mangled file (RecursionError too)
        reason = " ".join(str(e).split())[:200]
        raise ModelLoadError(f"model {name!r}: the tokenizer in {folder} could not be read ({type(e).__name__}: "
                             f"{reason})") from None
    gen_path = folder / "generation_config.json"
    gen_cfg = _read_json(gen_path, name) if gen_path.exists() else {}
    return tokenizer, _eos_ids(cfg, gen_cfg, tokenizer)


def _check_files(folder: Path, name: str) -> None:
    """Refuse a model folder holding a FIFO, a device or a socket (libraries would block on or read forever
    from one); links to regular files are fine (the Hugging Face cache is made of them)."""
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir():
            try:
                check_regular(entry, ModelLoadError)
            except ModelLoadError as e:
                raise ModelLoadError(f"model {name!r}: {e}") from None


def _hub_download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    files = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
    where = {"revision": hub.revision_of(repo_id), "local_files_only": hub.unreachable() is not None}
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=files, **where))
        if not any(folder.glob("*.safetensors")):  # an older repo: its PyTorch weight files instead
            folder = Path(snapshot_download(repo_id, allow_patterns=files + [BIN_WEIGHTS], **where))
        return folder
    except GatedRepoError:
        raise ModelLoadError(f"model {repo_id!r}: gated on the Hugging Face Hub; accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model {repo_id!r}: not found on the Hugging Face Hub (or private without a token)") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id!r}: not in the local Hugging Face cache and the Hub can't be reached "
            f"({hub.unreachable() or 'the download stopped'}); download it where there is network access and pass "
            "the folder"
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


class _RankWeights(Mapping):
    """A checkpoint's tensors as this rank holds them: each read (only its part) when accessed.

    `sources` maps Hugging Face names to tensors or safetensors slices."""

    def __init__(self, sources: Mapping[str, Any], args: ModelArgs, shard: Shard) -> None:
        self.sources, self.args, self.shard = sources, args, shard

    def __getitem__(self, name: str) -> torch.Tensor:
        return shard_weight(name, self.sources[name], self.args, self.shard)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def build_network(
    sources: Mapping[str, Any], cfg: dict[str, Any], dtype: torch.dtype, device: str, tp: int = 1,
    exact_heads: bool = False, name: str = "model",
) -> Transformer:
    """The engine network of a checkpoint's tensors, as this rank of `tp` holds it (`name`: for errors)."""
    try:
        reason = unsupported(cfg)
        args = ModelArgs.from_hf(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"model {name!r}: its config.json lacks or mangles {e}") from None
    if reason:
        raise ModelLoadError(f"model {name!r}: {reason}")
    is_prm = "score.0.weight" in sources or any("ProcessRewardModel" in a for a in cfg.get("architectures") or [])
    if is_prm and "score.0.weight" not in sources:
        raise ModelLoadError("checkpoint declares a process reward model but has no score.0/score.2 head weights")
    try:
        d = shard_degree(args.n_heads, args.n_kv_heads, args.intermediate_size, tp, exact_heads=exact_heads)
        shard = make_shard(d) if tp > 1 else Shard()
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    with torch.device("meta"):
        kind = ProcessRewardModel if is_prm else ValueHeadModel if VALUE_HEAD in sources else CausalLM
        net: Transformer = kind(args, shard)
    net.load_state_dict(hf_to_engine_state_dict(_RankWeights(sources, args, shard), args), assign=True)
    if isinstance(net, CausalLM):
        net.tie_weights()
    return net.to(device=device, dtype=dtype).eval()


def _load_folder(folder: Path, name: str, **place: Any) -> LoadedModel:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"model {name!r}: {folder} has no config.json")
    _check_files(folder, name)
    cfg = _read_json(cfg_path, name)
    sources = _weight_sources(folder, name)
    try:
        net = build_network(sources, cfg, **place, name=name)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:
        reason = " ".join(str(e).split())[:300]
        raise ModelLoadError(f"model {name!r}: the weights in {folder} do not fit its config.json "
                             f"({type(e).__name__}: {reason})") from None
    tokenizer, eos_ids = _tokenizer(folder, name, cfg)
    return LoadedModel(net, tokenizer, cfg, name, eos_ids)


def _weight_sources(folder: Path, name: str) -> dict[str, Any]:
    """The folder's tensors by name, none loaded: its safetensors files' slices (headers read, data mapped) or,
    in a folder without any, its PyTorch weight files' tensors (`BIN_WEIGHTS`, memory-mapped; read with
    `weights_only`, which unpickles tensors and nothing else: model files are untrusted). A `ModelLoadError`
    where it has neither or a file cannot be read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob(BIN_WEIGHTS))
        if not bins:
            raise ModelLoadError(f"model {name!r}: {folder} has no .safetensors weights (nor {BIN_WEIGHTS} files)")
        return {key: tensor for f in bins for key, tensor in _bin_tensors(f, name).items()}
    sources = {}
    for f in files:
        try:
            handle = safe_open(f, framework="pt")
        except (SafetensorError, OSError) as e:  # empty, truncated header, or not safetensors at all
            raise ModelLoadError(f"model {name!r}: {f} is not a readable safetensors file ({e})") from None
        sources.update({key: handle.get_slice(key) for key in handle.keys()})
    return sources


def _bin_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    """A PyTorch weight file's tensors by name (`torch.load` with `weights_only`, memory-mapped)."""
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # weights_only refusing an object, a truncated zip, not a torch file: many types
        reason = " ".join(str(e).split())[:200]
        raise ModelLoadError(f"model {name!r}: {path} is not a readable PyTorch weight file ({type(e).__name__}: "
                             f"{reason})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ModelLoadError(f"model {name!r}: {path} holds no state dict (tensors by name)")
    return tensors


def tensor_names(folder: str | Path) -> set[str]:
    """The tensor names of a local checkpoint folder, as the loader reads them (no tensor loaded); a
    `ModelLoadError` where it has no weights or one file cannot be read."""
    return set(_weight_sources(Path(folder).expanduser(), str(folder)))


def _read_json(path: Path, name: str) -> dict[str, Any]:
    """A JSON object file of a model folder (a regular file within `CONFIG_LIMIT`); anything else is a
    `ModelLoadError` naming it."""
    try:
        data = json.loads(read_regular(path, CONFIG_LIMIT, ModelLoadError).decode("utf-8"))
    except ModelLoadError as e:
        raise ModelLoadError(f"model {name!r}: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"model {name!r}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"model {name!r}: {path} is not a JSON object")
    return data


def _load_gguf(path: Path, **place: Any) -> LoadedModel:
    """Dequantise a GGUF file through transformers' GGUF loader, then map its weights into the engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        check_regular(path, ModelLoadError)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  **_gguf_config_fixes(check_gguf_header(path, (QWEN3_HEAD_DIM,))))
    except ModelLoadError:
        raise
    except GGUFBoundsError as e:
        raise ModelLoadError(f"model {str(path)!r}: not a readable GGUF file ({e})") from None
    except Exception as e:  # the GGUF reader raises ValueError, struct.error, KeyError, ... on a mangled file
        reason = " ".join(str(e).split())[:200]
        raise ModelLoadError(f"model {str(path)!r}: not a readable GGUF file ({type(e).__name__}: {reason})") from None
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    net = build_network(dict(hf.state_dict()), cfg, **place, name=str(path))
    gen_cfg = hf.generation_config.to_dict()
    del hf
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return LoadedModel(net, tokenizer, cfg, str(path), _eos_ids(cfg, gen_cfg, tokenizer))


def _gguf_config_fixes(header: dict[str, int]) -> dict[str, Any]:
    """Config fields transformers does not take from a GGUF file, from the values `check_gguf_header` read: a
    Qwen3's head size (it keeps Qwen3Config's default, 128, over the file's `qwen3.attention.key_length`)."""
    return {"head_dim": header[QWEN3_HEAD_DIM]} if QWEN3_HEAD_DIM in header else {}
