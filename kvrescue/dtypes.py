"""Weight dtypes by name: the names `--dtype` accepts (with their short aliases) and bytes per element."""

NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
         "float16": "float16", "fp16": "float16"}  # a --dtype name -> its torch dtype's name
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # a torch dtype's name -> bytes per element


def dtype_bytes(name: str) -> int:
    """Bytes per element of a --dtype name (an alias included) or a config.json `torch_dtype`."""
    return BYTES[NAMES.get(name, name)]
