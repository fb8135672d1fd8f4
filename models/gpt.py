"""A decoder-only transformer (GPT style): pre-norm blocks, causal attention, untied head.

Layout follows torchtitan so that parallelism can be applied from outside: the blocks live in
``layers`` (a ModuleDict keyed by index: the split points of pipeline stages), parts may be
absent (None) so that a stage is the model minus the other stages' parts, and attention reads its head count
from the local projection width, so a column-sharded ``q_proj`` under tensor parallelism works
unchanged. The TP plan and pipeline split are plain data in the spec (``ParallelPlan``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.registry import DataInfo, ModelSpec, ParallelPlan, register


class Attention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        heads = q.shape[-1] // self.head_dim  # local heads: fewer under tensor parallelism
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class FeedForward(nn.Module):
    """Two linear layers with a GELU between, 4x wide."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final norm, linear head to the vocabulary."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq_len: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim ({dim}) must be divisible by n_heads ({n_heads})")
        self.dim, self.n_layers, self.n_heads = dim, n_layers, n_heads
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        # A dict keyed "0".."n-1": a pipeline stage drops the others and keeps these names.
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor) -> Tensor:
        # Parts set to None are absent (a pipeline stage holds a slice): the input is then the
        # previous part's hidden state, and the output is this slice's.
        h = tokens
        if self.tok_embeddings is not None:
            t = tokens.shape[1]
            if t > self.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds max_seq_len {self.max_seq_len}")
            h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(t, device=tokens.device))
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def build(
    info: DataInfo,
    dim: int = 384,
    n_layers: int = 6,
    n_heads: int = 6,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> nn.Module:
    """Build a GPT for token data; vocabulary and context length default to the data's."""
    seq_len = info.input_shape[0]
    return GPT(
        vocab_size=vocab_size or info.num_classes,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        max_seq_len=max(max_seq_len or seq_len, seq_len),
    )


def training_flops_per_sample(model: nn.Module, info: DataInfo) -> float:
    """6 x (matmul parameters) x tokens + attention scores (PaLM appendix B), per sequence."""
    seq_len = info.input_shape[0]
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attention = 12 * model.n_layers * model.dim * seq_len
    return float(seq_len * (6 * matmul_params + attention))


# Tensor-parallel plan as data (applied by rayjobs.parallel): module path pattern -> style.
TP_PLAN = {
    "layers.*.attn.q_proj": "colwise",
    "layers.*.attn.k_proj": "colwise",
    "layers.*.attn.v_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.ffn.up_proj": "colwise",
    "layers.*.ffn.down_proj": "rowwise",
}

register(
    ModelSpec(
        name="gpt",
        builder=build,
        flavors={
            "debug": {"dim": 32, "n_layers": 2, "n_heads": 4},
            "small": {"dim": 384, "n_layers": 6, "n_heads": 6},  # ~10.6M in the blocks
            "medium": {"dim": 768, "n_layers": 14, "n_heads": 12},  # ~99M in the blocks
            "1b": {"dim": 2048, "n_layers": 20, "n_heads": 16},  # ~1.0B in the blocks
        },
        data_kinds=("tokens",),
        default_flavor="small",
        description="decoder-only transformer for next-token prediction",
        flops_per_sample=training_flops_per_sample,
        ranges={
            "dim": (1, None),
            "n_layers": (1, None),
            "n_heads": (1, None),
            "vocab_size": (1, None),
            "max_seq_len": (1, None),
        },
        parallel=ParallelPlan(
            layers_attr="layers",
            tp_plan=TP_PLAN,
            # Pipeline split: the first stage keeps the embeddings, the last the norm and head.
            pipeline_first=("tok_embeddings", "pos_embeddings"),
            pipeline_last=("norm", "output"),
        ),
    )
)
