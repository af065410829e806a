"""A GPT decoder LM - nanoGPT's `model.py` GPT, and so GPT-2's architecture,
with `bias`, `tie_embeddings`, `activation` and `n_positions` - and a tiny token
MLP for fast tests (the protocol they follow: harness/models/__init__.py)."""

from __future__ import annotations

import json
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


# `model.activation` (transformers' `activation_function` names) -> F.gelu's `approximate`
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh"}


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float, bias: bool = True, activation: str = "gelu"):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, d_model, bias=bias)
        self.residual_dropout = nn.Dropout(dropout)
        self.approximate = GELU_APPROXIMATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(self.out_proj(F.gelu(self.fc(x), approximate=self.approximate)))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool = True, activation: str = "gelu"):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias)
        self.ln_mlp = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, 4 * d_model, dropout, bias, activation)

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
    attention, 4x GELU MLP; embedding, attention and residual dropout as nanoGPT's.
    `bias`: biases in every Linear and LayerNorm (GPT-2's; nanoGPT's `bias`);
    `tie_embeddings`: the output head is the token embedding table (GPT-2's and
    nanoGPT's). Both true by default: GPT-2's shape. `activation`: `gelu`, the exact
    GELU (nanoGPT's), or `gelu_new`, its tanh approximation (GPT-2's checkpoints');
    `n_positions`: the position table's rows (GPT-2's `n_positions`), null for
    `seq_len`; rows past `seq_len` are not used."""

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
        activation: str = "gelu",
        n_positions: int | None = None,
    ):
        require_positive(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab_size=vocab_size)
        require_probability(dropout)
        if d_model % n_head:
            raise ValueError(
                f"model.d_model={d_model} is not divisible by model.n_head={n_head}. "
                f"Fix: pick n_head dividing d_model, e.g. model.n_head={nearest_divisor(d_model, n_head)}."
            )
        if activation not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"model.activation={activation!r} is not an activation model=gpt computes. Fix: model.activation=gelu "
                "(the exact GELU, nanoGPT's) or model.activation=gelu_new (the tanh approximation, GPT-2's)."
            )
        if n_positions is not None:
            require_positive(n_positions=n_positions)
            if seq_len > n_positions:
                raise ValueError(
                    f"train.seq_len={seq_len} is longer than model.n_positions={n_positions}, the position table's "
                    "rows (with model.init_from, config.json's n_positions): no position past them has an embedding. "
                    f"Fix: train.seq_len={n_positions} or less; without model.init_from, model.n_positions=null also "
                    "works (a table of train.seq_len rows)."
                )
        self.activation = activation
        blocks = [GPTBlock(d_model, n_head, dropout, bias, activation) for _ in range(n_layer)]
        positions = n_positions or seq_len
        super().__init__(vocab_size, d_model, blocks, positions, bias, tie_embeddings, embedding_dropout=dropout)

    def hf_names(self) -> dict[str, str]:
        """Each parameter's name in transformers' GPT2LMHeadModel (a tied table once, as the embedding)."""
        names = {}
        for fqn, _ in self.named_parameters():
            module, _, kind = fqn.rpartition(".")
            names[fqn] = f"{gpt2_name(module)}.{kind}"
        return names

    @staticmethod
    def hf_layout(fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """Parameter `fqn`'s `tensor` as GPT2LMHeadModel holds it, a view, so that one map serves both ways
        (`model.init_from` reads into it in place, `harness.export` writes it): the blocks' Linear weights
        transposed, since GPT-2's Conv1D stores [in, out]."""
        return tensor.t() if fqn.startswith("blocks.") and tensor.dim() == 2 else tensor

    def hf_missing(self) -> dict[str, torch.Tensor]:
        """What GPT2LMHeadModel holds and this model does not, for the export: a zero bias for each
        Linear and LayerNorm built without one (GPT-2 always has them; zero computes the same)."""
        missing = {}
        for fqn, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module is not self.head and module.bias is None:
                shape = module.out_features if isinstance(module, nn.Linear) else module.normalized_shape
                missing[f"{gpt2_name(fqn)}.bias"] = torch.zeros(shape, dtype=module.weight.dtype)
        return missing

    def hf_config(self) -> dict:
        """The config.json of the same model in transformers (GPT2Config's keys): the run's GELU
        (`gelu`, exact; GPT-2's own checkpoints use `gelu_new`), nn.LayerNorm's epsilon, the run's dropout."""
        attention = self.blocks[0].attn
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.tok_emb.num_embeddings,
            "n_positions": self.pos_emb.num_embeddings,
            "n_embd": self.tok_emb.embedding_dim,
            "n_layer": len(self.blocks),
            "n_head": attention.n_head,
            "n_inner": self.blocks[0].mlp.fc.out_features,
            "activation_function": self.activation,
            "layer_norm_epsilon": self.ln_f.eps,
            "resid_pdrop": attention.residual_dropout.p,
            "embd_pdrop": self.emb_dropout.p,
            "attn_pdrop": attention.dropout,
            "tie_word_embeddings": self.head.weight is self.tok_emb.weight,
            # GPT2Config's defaults are GPT-2's tokenizer's (50256); the export sets the run's tokenizer's
            "bos_token_id": None,
            "eos_token_id": None,
            "dtype": "float32",
        }


class TokenMLP(TokenLM):
    """Residual MLP blocks over token embeddings (no attention, no positions): the fast test model."""

    def __init__(
        self, n_layer: int, d_model: int, hidden: int, vocab_size: int, seq_len: int | None = None, dropout: float = 0.0
    ):
        require_positive(n_layer=n_layer, d_model=d_model, hidden=hidden, vocab_size=vocab_size)
        require_probability(dropout)
        blocks = [MLPBlock(d_model, hidden, dropout) for _ in range(n_layer)]
        super().__init__(vocab_size, d_model, blocks, seq_len=None)


GPT2_NAMES = {  # our module names' parts as transformers' GPT2LMHeadModel spells them
    "tok_emb": "transformer.wte",
    "pos_emb": "transformer.wpe",
    "blocks": "transformer.h",
    "ln_f": "transformer.ln_f",
    "head": "lm_head",
    "ln_attn": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.out_proj": "attn.c_proj",
    "ln_mlp": "ln_2",
    "mlp.fc": "mlp.c_fc",
    "mlp.out_proj": "mlp.c_proj",
}


def gpt2_name(fqn: str) -> str:
    """A GPT module's name in transformers' GPT2LMHeadModel (`blocks.0.attn.qkv` -> `transformer.h.0.attn.c_attn`)."""
    top, _, rest = fqn.partition(".")
    if top != "blocks":
        return GPT2_NAMES[fqn]
    layer, _, inner = rest.partition(".")
    return f"{GPT2_NAMES[top]}.{layer}.{GPT2_NAMES[inner]}"


def keys_from_hf_config(hf, init_from: str) -> dict:
    """model=gpt's architecture keys from transformers config `hf` (read from `init_from`'s config.json,
    a GPT2LMHeadModel's); ValueError with the fix `model=hf` for what model=gpt does not compute."""
    key = f"model.init_from={init_from!r}"
    if hf.model_type != "gpt2":
        raise ValueError(
            f"{key}: its config.json is a {type(hf).__name__} (model_type={hf.model_type!r}), not a GPT-2. "
            f"Fix: model=hf model.init_from={init_from} (any transformers causal LM; model=llama for a Llama)."
        )
    computed = {  # config.json's keys and the values model=gpt computes
        "activation_function": tuple(GELU_APPROXIMATIONS),
        "n_inner": (None, 4 * hf.n_embd),
        "layer_norm_epsilon": (1e-5,),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
    }
    for name, values in computed.items():
        if getattr(hf, name) not in values:
            raise ValueError(
                f"{key}: its config.json has {name}={json.dumps(getattr(hf, name))}, and model=gpt computes "
                f"{name}={' or '.join(json.dumps(v) for v in values)} only. "
                f"Fix: model=hf model.init_from={init_from} (transformers computes it)."
            )
    return {
        "vocab_size": hf.vocab_size,
        "d_model": hf.n_embd,
        "n_layer": hf.n_layer,
        "n_head": hf.n_head,
        "n_positions": hf.n_positions,
        "activation": hf.activation_function,
        "bias": True,  # GPT-2 has a bias in every Linear and LayerNorm
        "tie_embeddings": hf.tie_word_embeddings,
    }
