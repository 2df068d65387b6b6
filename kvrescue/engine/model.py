"""One compact decoder for the Qwen2, Qwen3 and Llama (Mistral) families (gpt-fast style), plus the LM, PRM and value
heads.

Attention is delegated to a `KVCache` so the same decoder serves the evicting base, the full-context
helper and the PRM; without a cache it runs a plain causal forward. Under tensor parallelism (`tp.py`)
a network holds one rank's shard: its `args` are the shapes that rank computes (its heads, its MLP
columns), and `shard` does the all-reduces and the logits' all-gather.
"""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvrescue.engine.invariance as invariance
from kvrescue.engine.caches import KVCache
from kvrescue.engine.tp import Shard
from kvrescue.engine.transfer import upload
from kvrescue.model_config import ModelArgs
from kvrescue.shapes import local_args


VALUE_HEAD = "v_head.summary.weight"  # a value-head checkpoint's head weight (and its .bias)

# Rows up to which a bf16 linear layer on a CPU computes W @ xT (matrix-vector products) rather than x @ WT: there
# MKL/oneDNN read the weight faster; fp32 gains nothing (docs/benchmarks.md, benchmarks/speed/linear_bench.py).
GEMV_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); for a bf16 x on a CPU with up to GEMV_ROWS rows, as (weight @ xT)T (torch.mv for one),
    made contiguous (a transposed result would send the attention that follows to SDPA's slow math kernel). With
    batch invariance on, in the row chunks of `invariance.linear_rows`."""
    return invariance.linear_rows(x, weight, bias, _linear)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or rows > GEMV_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    y = torch.mv(weight, flat[0])[None] if rows == 1 else (weight @ flat.T).T.contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class HeadLinear(nn.Linear):
    """nn.Linear of a replicated head (PRM, value head): F.linear, in `invariance.linear_rows`' chunks when batch
    invariance is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariance.linear_rows(x, self.weight, self.bias, F.linear)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32 rounded to x's dtype, as Hugging Face's Qwen2RMSNorm computes it: rms_norm
        # of a bf16 or fp16 x computes in fp32 itself (the same values as of x.float(), two ops fewer), then the weight
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


def rope_frequencies(head_dim: int, theta: float, device: torch.device,
                     llama3: tuple[float, float, float, int] | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies [D/2]; with Llama 3.1's scaling (factor, low and high frequency factors, original
    context) as transformers computes it: wavelengths beyond original / low divided by the factor, those below
    original / high kept, those between interpolated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 llama3: tuple[float, float, float, int] | None = None):
    """cos and signed sin [R, 1, T, D] for integer positions [R, T] (Hugging Face rotate-half layout): the sin of
    the first half negated, so that `apply_rope` rotates with one `roll`."""
    inv_freq = rope_frequencies(head_dim, theta, positions.device, llama3)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin = emb.sin()
    sin[..., : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, half) * signed_sin (same values:
    a negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, shard: Shard) -> None:
        super().__init__()
        self.layer, self.shard = layer, shard
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None  # Qwen3: per head, before RoPE
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        R, T, _ = x.shape
        heads = [self.n_heads, self.n_kv_heads]
        qkv = self.wqkv(x).view(R, T, -1, self.head_dim).transpose(1, 2)
        qk, v = qkv.split([sum(heads), self.n_kv_heads], dim=1)  # views: one op where indexing dispatches several
        if self.q_norm is not None:
            q, k = qk.split(heads, dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = apply_rope(qk, cos, sin).split(heads, dim=1)  # the queries' and keys' heads in one pass
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        else:
            y = cache.attend(self.layer, q, k, v)
        return self.shard.all_reduce(self.wo(y.transpose(1, 2).reshape(R, T, self.n_heads * self.head_dim)))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.shard.all_reduce(self.w2(F.silu(gate) * up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, shard: Shard) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer, shard)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args, shard)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class VocabEmbedding(nn.Module):
    """The token embedding, or this rank's rows of it (vocab-parallel: lookups summed over the ranks)."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.start, rows = shard.rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.shard.all_reduce(torch.where(mine[..., None], x, 0.0))


class VocabHead(nn.Module):
    """The LM head, or this rank's rows of it (vocab-parallel: logits gathered from the ranks)."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard) -> None:
        super().__init__()
        self.shard, self.vocab_size = shard, vocab_size
        self.weight = nn.Parameter(torch.empty(shard.rows(vocab_size)[1], dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.shard.all_gather(linear(h, self.weight))[..., : self.vocab_size]


class Decoder(nn.Module):
    """Embedding, blocks and final norm: tokens in, normalised hidden states out."""

    def __init__(self, args: ModelArgs, shard: Shard) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = VocabEmbedding(args.vocab_size, args.dim, shard)
        self.layers = nn.ModuleList(Block(args, i, shard) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype, self.args.llama3_rope)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        return self.norm(x)


class Transformer(nn.Module):
    """A decoder with a head that maps hidden states [..., dim] to outputs [..., out].

    `args` are the checkpoint's shapes; the network keeps the shapes its rank computes (`local_args`).
    """

    def __init__(self, args: ModelArgs, head: nn.Module, shard: Shard = Shard()) -> None:
        super().__init__()
        self.args, self.shard = local_args(args, shard.size), shard
        self.decoder = Decoder(self.args, shard)
        self.head = head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a cache: tokens [B, T] -> head outputs [B, T, out]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return self.head(self.decoder(tokens, positions, None))

    @torch.inference_mode()  # the caches' per-layer views are written in place: never where autograd records
    def prefill(
        self, tokens: torch.Tensor, cache: KVCache, rows: list[int], n_new: list[int], last_only: bool = True
    ) -> torch.Tensor:
        """Append n_new[i] tokens (tokens [R, T], right padded) to rows[i] of `cache`.

        Returns head outputs at each row's last new token [R, out], or at every position [R, T, out].
        """
        h = self.append_hidden(tokens, cache, rows, n_new)
        if not last_only:
            return self.head(h)
        last = upload(np.asarray(n_new, np.int64) - 1, h.device)
        return self.head(h[torch.arange(len(rows), device=h.device), last])

    @torch.inference_mode()
    def append_hidden(self, tokens: torch.Tensor, cache: KVCache, rows: list[int], n_new: list[int]) -> torch.Tensor:
        """`prefill` without the head: the decoder's hidden states [R, T, dim] at every new position."""
        positions = cache.begin(rows, n_new)
        try:
            return self.decoder(tokens, positions, cache)
        finally:
            cache.end()

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, cache: KVCache, rows: list[int]) -> torch.Tensor:
        """Append one token per row (tokens [R]); returns head outputs [R, out]."""
        positions = cache.begin(rows, [1] * len(rows))
        try:
            h = self.decoder(tokens[:, None], positions, cache)
        finally:
            cache.end()
        return self.head(h[:, 0])


class CausalLM(Transformer):
    """Decoder + language-model head (tied to the embedding when the checkpoint says so)."""

    def __init__(self, args: ModelArgs, shard: Shard = Shard()) -> None:
        super().__init__(args, VocabHead(args.vocab_size, args.dim, shard), shard)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config ties them."""
        if self.args.tie_word_embeddings:
            self.head.weight = self.decoder.tok_embeddings.weight


class ProcessRewardModel(Transformer):
    """Qwen2ForProcessRewardModel: decoder + score head Linear(H,H) -> ReLU -> Linear(H,2)."""

    def __init__(self, args: ModelArgs, shard: Shard = Shard()) -> None:
        score = nn.Sequential(HeadLinear(args.dim, args.dim), nn.ReLU(), HeadLinear(args.dim, 2))  # replicated
        super().__init__(args, score, shard)


class ValueHeadModel(Transformer):
    """A decoder with a value head `v_head.summary`: Linear(H, 1) (Skywork's PRM, TRL's AutoModelForCausalLMWithValueHead)."""

    def __init__(self, args: ModelArgs, shard: Shard = Shard()) -> None:
        super().__init__(args, HeadLinear(args.dim, 1), shard)  # replicated


def hf_to_engine_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Map Hugging Face Qwen2/Qwen3/Llama/Mistral(/PRM, value head) weight names to this module's, fusing q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {}
    pre = "model."
    out["decoder.tok_embeddings.weight"] = sd[pre + "embed_tokens.weight"]
    out["decoder.norm.weight"] = sd[pre + "norm.weight"]
    for i in range(args.n_layers):
        p, o = f"{pre}layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        out[o + "attention.wqkv.weight"] = torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        if args.qkv_bias:
            out[o + "attention.wqkv.bias"] = torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        out[o + "attention.wo.weight"] = sd[a + "o_proj.weight"]
        if args.qk_norm:
            out[o + "attention.q_norm.weight"] = sd[a + "q_norm.weight"]
            out[o + "attention.k_norm.weight"] = sd[a + "k_norm.weight"]
        m = p + "mlp."
        out[o + "feed_forward.w13.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        out[o + "feed_forward.w2.weight"] = sd[m + "down_proj.weight"]
        out[o + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[o + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    if "score.0.weight" in sd:
        for k in ("0.weight", "0.bias", "2.weight", "2.bias"):
            out["head." + k] = sd["score." + k]
    elif VALUE_HEAD in sd:
        out["head.weight"], out["head.bias"] = sd[VALUE_HEAD], sd["v_head.summary.bias"]
    else:
        out["head.weight"] = out["decoder.tok_embeddings.weight"] if args.tie_word_embeddings else sd["lm_head.weight"]
    return out
