"""A GPT decoder LM - nanoGPT's `model.py` GPT, and so GPT-2's architecture,
with `bias` and `tie_embeddings` - and a tiny token MLP for fast tests (the
protocol they follow: harness/models/__init__.py)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.models.arguments import nearest_divisor, require_positive, require_probability
from harness.models.loss import lm_loss


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool = True):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.residual_dropout(self.out_proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, d_model, bias=bias)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(self.out_proj(F.gelu(self.fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool = True):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias)
        self.ln_mlp = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, 4 * d_model, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class TokenLM(nn.Module):
    """Embeddings (dropped out at `embedding_dropout`) -> blocks -> final norm -> head (never a
    bias, as nanoGPT's); returns mean cross-entropy. `bias`: the final norm's; `tie_embeddings`: the
    head's weight is the token embedding table (one parameter, named `tok_emb.weight` first, as
    nanoGPT's `wte`)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        blocks: list[nn.Module],
        seq_len: int | None,
        bias: bool = True,
        tie_embeddings: bool = False,
        embedding_dropout: float = 0.0,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model) if seq_len else None
        self.emb_dropout = nn.Dropout(embedding_dropout)  # p=0 dispatches nothing
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's count: 6 per parameter outside
        the embedding tables (lookups are not matmuls; biases and norm weights are
        counted too, as torchtitan does: a rounding error next to the matrices)
        plus causal attention's 12 * layers * d_model * seq_len. A token table
        tied to the head is the head's matmul too, so it counts then."""
        tables = [emb.weight for emb in (self.tok_emb, self.pos_emb) if emb is not None]
        weights = sum(p.numel() for p in self.parameters())
        weights -= sum(table.numel() for table in tables if table is not self.head.weight)
        attention_layers = sum(isinstance(block, GPTBlock) for block in self.blocks)
        return 6 * weights + 12 * attention_layers * self.ln_f.normalized_shape[0] * seq_len

    def initial_value(self, fqn: str, module: nn.Module, shape: tuple, generator: torch.Generator) -> torch.Tensor:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by
        1/sqrt(2 * n_layer), norms 1, biases 0."""
        name = fqn.rpartition(".")[2]
        if isinstance(module, nn.LayerNorm):
            return torch.ones(shape) if name == "weight" else torch.zeros(shape)
        if name == "bias":
            return torch.zeros(shape)
        std = 0.02 / math.sqrt(2 * len(self.blocks)) if fqn.endswith("out_proj.weight") else 0.02
        return torch.randn(shape, generator=generator) * std

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.emb_dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.output_loss(x, targets)

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The tail after the blocks: final norm, head and the mean cross-entropy in fp32."""
        return lm_loss(self.head(self.ln_f(x)), targets)


class GPT(TokenLM):
    """Pre-norm GPT decoder, nanoGPT's `model.py` GPT: learned positions, causal
    attention, 4x exact-GELU MLP; embedding, attention and residual dropout as nanoGPT's.
    `bias`: biases in every Linear and LayerNorm (GPT-2's; nanoGPT's `bias`);
    `tie_embeddings`: the output head is the token embedding table (GPT-2's and
    nanoGPT's). Both true by default: GPT-2's shape."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        d_model: int,
        vocab_size: int,
        seq_len: int,
        dropout: float = 0.0,
        bias: bool = True,
        tie_embeddings: bool = True,
    ):
        require_positive(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab_size=vocab_size)
        require_probability(dropout)
        if d_model % n_head:
            raise ValueError(
                f"model.d_model={d_model} is not divisible by model.n_head={n_head}. "
                f"Fix: pick n_head dividing d_model, e.g. model.n_head={nearest_divisor(d_model, n_head)}."
            )
        blocks = [GPTBlock(d_model, n_head, dropout, bias) for _ in range(n_layer)]
        super().__init__(vocab_size, d_model, blocks, seq_len, bias, tie_embeddings, embedding_dropout=dropout)


class TokenMLP(TokenLM):
    """Residual MLP blocks over token embeddings (no attention, no positions): the fast test model."""

    def __init__(
        self, n_layer: int, d_model: int, hidden: int, vocab_size: int, seq_len: int | None = None, dropout: float = 0.0
    ):
        require_positive(n_layer=n_layer, d_model=d_model, hidden=hidden, vocab_size=vocab_size)
        require_probability(dropout)
        blocks = [MLPBlock(d_model, hidden, dropout) for _ in range(n_layer)]
        super().__init__(vocab_size, d_model, blocks, seq_len=None)
