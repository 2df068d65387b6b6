"""A loaded model with one cache: token lists in, next-token logits out (no policy here)."""

from __future__ import annotations

import torch

from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import KVCache
from kvrescue_cli.engine.graphs import StaticDecode
from kvrescue_cli.engine.loader import LoadedModel
from kvrescue_cli.engine.steps import append_tokens


class Runner:
    """Appends tokens to the cache rows of one model and returns the logits that follow them."""

    def __init__(self, model: LoadedModel, cache: KVCache, cuda_graphs: bool = False) -> None:
        """`cuda_graphs`: on a GPU, a bounded cache's one-token steps run as captured CUDA graphs."""
        self.model = model
        self.cache = cache
        self.tokenizer = model.tokenizer
        graphed = cuda_graphs and isinstance(cache, BoundedCache) and model.device.type == "cuda"
        self.static = StaticDecode(model.net, cache) if graphed else None

    def append(self, rows: list[int], token_lists: list[list[int]]) -> torch.Tensor:
        """Append token_lists[i] to rows[i] in one forward; the fp32 logits after each row's last token [R, V]."""
        return append_tokens(self.model, self.cache, rows, token_lists)

    @torch.inference_mode()
    def step(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """Append one token to each row; the fp32 logits that follow [R, V]."""
        if self.static is not None:
            return self.static(rows, tokens).float()
        batch = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
        return self.model.net.decode(batch, self.cache, rows).float()

    def rows_held(self, row: int) -> int:
        """Entries this row's cache holds now: its physical length (the logical one for a full cache)."""
        physical = getattr(self.cache, "physical_length", None)
        return physical(row) if physical is not None else self.cache.length(row)

    def peak_rows(self, row: int) -> int:
        """The largest physical length this row (and the forks it adopted) reached."""
        peak = getattr(self.cache, "peak_length", None)
        return peak(row) if peak is not None else self.cache.length(row)
