"""Models: a small GPT-style decoder LM and a tiny token MLP for fast tests.

A model is an `nn.Module` class named by `model._target_` and built by
`build_model` from its config keys plus `seq_len`, on the meta device (no
memory, no init); `materialize` gives it values after sharding, so every rank
- and a single-process reference - holds the same weights whatever the
layout. A model exposes its repeated layers as `blocks` (the unit FSDP wraps
and `train.compile` compiles), returns the LM loss from `forward(tokens,
targets)` and counts its `flops_per_token`. Its constructor refuses bad
arguments with a ValueError naming the key and the fix; `validate` builds it
on the meta device to ask.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.rng import seeded_generator


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.residual_dropout(self.out_proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out_proj = nn.Linear(hidden, d_model)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(self.out_proj(F.gelu(self.fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model, dropout)

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
    """Embeddings -> blocks -> final norm -> head; returns mean cross-entropy."""

    def __init__(self, vocab_size: int, d_model: int, blocks: list[nn.Module], seq_len: int | None):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model) if seq_len else None
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's count: 6 per parameter outside
        the embeddings (lookups are not matmuls; biases and norm weights are
        counted too, as torchtitan does: a rounding error next to the matrices)
        plus causal attention's 12 * layers * d_model * seq_len."""
        weights = sum(p.numel() for name, p in self.named_parameters() if "emb" not in name.split(".")[0])
        attention_layers = sum(isinstance(block, GPTBlock) for block in self.blocks)
        return 6 * weights + 12 * attention_layers * self.ln_f.normalized_shape[0] * seq_len

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT(TokenLM):
    """Pre-norm GPT decoder: learned positions, causal attention, 4x MLP;
    attention and residual dropout as nanoGPT's."""

    def __init__(self, n_layer: int, n_head: int, d_model: int, vocab_size: int, seq_len: int, dropout: float = 0.0):
        require_positive(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab_size=vocab_size)
        require_probability(dropout)
        if d_model % n_head:
            near = min((d for d in range(1, d_model + 1) if d_model % d == 0), key=lambda d: (abs(d - n_head), -d))
            raise ValueError(
                f"model.d_model={d_model} is not divisible by model.n_head={n_head}. "
                f"Fix: pick n_head dividing d_model, e.g. model.n_head={near}."
            )
        super().__init__(vocab_size, d_model, [GPTBlock(d_model, n_head, dropout) for _ in range(n_layer)], seq_len)


class TokenMLP(TokenLM):
    """Residual MLP blocks over token embeddings (no attention, no positions): the fast test model."""

    def __init__(
        self, n_layer: int, d_model: int, hidden: int, vocab_size: int, seq_len: int | None = None, dropout: float = 0.0
    ):
        require_positive(n_layer=n_layer, d_model=d_model, hidden=hidden, vocab_size=vocab_size)
        require_probability(dropout)
        blocks = [MLPBlock(d_model, hidden, dropout) for _ in range(n_layer)]
        super().__init__(vocab_size, d_model, blocks, seq_len=None)


def require_positive(**values: int) -> None:
    bad = [f"model.{k}={v}" for k, v in values.items() if v is None or v < 1]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} out of range: must be >= 1. "
            f"Fix: set {', '.join(b.split('=')[0] for b in bad)} to a positive integer."
        )


def require_probability(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout={dropout} must be in [0, 1). Fix: model.dropout=0.1, or 0.0 for none.")


# model-group keys the harness applies to any model (harness.sharding), not arguments of the class
HARNESS_KEYS = ("activation_checkpointing",)


def build_model(cfg: DictConfig, seq_len: int) -> TokenLM:
    """The model `cfg._target_` names, on the meta device."""
    spec = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in HARNESS_KEYS}
    with torch.device("meta"):
        return instantiate(spec, _partial_=True)(seq_len=seq_len)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate `model`'s (possibly sharded) parameters on `device` and initialise them.

    Each parameter's full value comes from its own generator, seeded by `seed`
    and its name, so the result does not depend on the layout: a rank copies
    its local shard of that value (GPT-2 style init: N(0, 0.02), residual
    output projections scaled by 1/sqrt(2 * n_layer), norms 1, biases 0).
    """
    model.to_empty(device=device)
    n_layer = len(getattr(model, "blocks", [])) or 1
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_name}.{name}" if module_name else name
            full = _initial_value(module, name, fqn, tuple(param.shape), seed, n_layer).to(device)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)


def _initial_value(module: nn.Module, name: str, fqn: str, shape: tuple, seed: int, n_layer: int) -> torch.Tensor:
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape) if name == "weight" else torch.zeros(shape)
    if name == "bias":
        return torch.zeros(shape)
    std = 0.02 / math.sqrt(2 * n_layer) if fqn.endswith("out_proj.weight") else 0.02
    return torch.randn(shape, generator=seeded_generator(seed, zlib.crc32(fqn.encode()))) * std
