"""Model revisions recorded in config.json: a local folder's content hash, a GGUF file's, a Hub id's commit."""

import hashlib
import shutil
import struct

import huggingface_hub.constants
import orjson

from kvrescue import hub
from kvrescue.model_config import model_revision


def expected_folder_revision(folder) -> str:
    """The documented recipe, recomputed: config.json, then each safetensors file's name, size and JSON header."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        data = weights.read_bytes()
        header = data[8:8 + int.from_bytes(data[:8], "little")]
        digest.update(weights.name.encode() + len(data).to_bytes(8, "little") + header)
    return "sha256:" + digest.hexdigest()


def test_a_local_folder_is_identified_by_its_config_and_weight_index(qwen2_dir, tmp_path):
    copy = shutil.copytree(qwen2_dir, tmp_path / "copy")
    revision = model_revision(str(copy))
    assert revision == expected_folder_revision(copy) == model_revision(str(qwen2_dir))
    config = orjson.loads((copy / "config.json").read_bytes())
    (copy / "config.json").write_bytes(orjson.dumps({**config, "rope_theta": 1.0}))
    assert model_revision(str(copy)) not in (revision, None)


def test_a_gguf_file_is_identified_by_its_size_and_head(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    data = gguf.read_bytes()
    assert model_revision(str(gguf)) == "sha256:" + hashlib.sha256(struct.pack("<Q", len(data)) + data).hexdigest()


def test_a_hub_id_is_its_commit_from_the_local_cache_when_offline(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub.config_file.cache_clear()
    assert model_revision("someone/tiny-model") == commit
    assert model_revision("someone/not-cached") is None  # unknown offline: null, the loader says why


def test_unreadable_or_truncated_weights_give_no_revision(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    assert model_revision(str(tmp_path)) is None
    assert model_revision("./no/such/folder") is None


def test_llama3_rope_scaling_is_read_and_other_scalings_refused():
    from kvrescue.model_config import ModelArgs, unsupported

    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
           "intermediate_size": 8, "num_hidden_layers": 1,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    assert unsupported(cfg) is None and ModelArgs.from_hf(cfg).llama3_rope == (8.0, 1.0, 4.0, 8192)
    assert ModelArgs.from_hf({**cfg, "rope_scaling": None}).llama3_rope is None
    assert "unsupported rope_scaling" in unsupported({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert unsupported({**cfg, "model_type": "mistral", "sliding_window": 4096}) is None
