"""Started first on PYTHONPATH (`tests.cuda_layouts.subprocess_env`): this Python's SDPA returns CUDA's layouts."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("cuda_layouts", Path(__file__).parents[1] / "cuda_layouts.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.install()
