"""The GGUF header walk hands the loader the values it asks for (a Qwen3's head size), so that loading a GGUF file
parses it only in transformers (gguf-py's reader keeps Python objects per vocabulary entry: SmolLM2's file took
about 4 s a parse, and transformers parses it three times already)."""

import traceback
from pathlib import Path

import gguf

import kvrescue
from kvrescue.engine import load_model
from kvrescue.engine.gguf_bounds import check_gguf_header
from kvrescue.engine.loader import QWEN3_HEAD_DIM
from tests.gguf_files import write_gguf


def test_the_walk_gives_the_wanted_integer_values_the_file_holds(qwen2_dir, qwen3_dir, tmp_path) -> None:
    qwen3, qwen2 = write_gguf(qwen3_dir, tmp_path / "qwen3.gguf"), write_gguf(qwen2_dir, tmp_path / "qwen2.gguf")
    assert check_gguf_header(qwen3, (QWEN3_HEAD_DIM, "qwen3.block_count")) == {QWEN3_HEAD_DIM: 32,
                                                                               "qwen3.block_count": 2}
    assert check_gguf_header(qwen2, (QWEN3_HEAD_DIM,)) == {} and check_gguf_header(qwen3) == {}


def test_loading_a_gguf_file_builds_no_gguf_reader_of_its_own(qwen3_dir, tmp_path, monkeypatch) -> None:
    callers = []
    real = gguf.GGUFReader.__init__

    def recorded(self, *args, **kwargs) -> None:
        callers.append(traceback.extract_stack()[-2].filename)
        real(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", recorded)
    load_model(write_gguf(qwen3_dir, tmp_path / "m.gguf"))  # its logits: tests/engine/test_model.py
    ours = str(Path(kvrescue.__file__).parent)
    assert callers and not [c for c in callers if c.startswith(ours)], callers
