"""Models: a small GPT-style decoder LM and a tiny token MLP for fast tests.

Both are built on the meta device (no memory, no init) and get their values
from `materialize` after sharding, so every rank - and a single-process
reference - holds the same weights whatever the layout. Both expose their
repeated layers as `blocks`, the unit FSDP wraps, and return the LM loss.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor, distribute_tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out_proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, hidden)

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
        """Training FLOPs per token, torchtitan's count: 6 per weight of every
        matmul (embedding lookups are not matmuls) plus causal attention's
        12 * layers * d_model * seq_len."""
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


def build_model(cfg: DictConfig, seq_len: int) -> TokenLM:
    """The model named by `cfg.name`, on the meta device."""
    with torch.device("meta"):
        if cfg.name == "gpt":
            blocks = [GPTBlock(cfg.d_model, cfg.n_head) for _ in range(cfg.n_layer)]
            return TokenLM(cfg.vocab_size, cfg.d_model, blocks, seq_len)
        if cfg.name == "mlp":
            blocks = [MLPBlock(cfg.d_model, cfg.hidden) for _ in range(cfg.n_layer)]
            return TokenLM(cfg.vocab_size, cfg.d_model, blocks, seq_len=None)
    raise ValueError(f"model.name={cfg.name!r} is not a known model (gpt, mlp)")


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
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63)
    return torch.randn(shape, generator=generator) * std
