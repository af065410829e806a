"""Llama 3 (Meta's and torchtitan's layout): RMSNorm, rotary position
embeddings, SwiGLU MLP, grouped-query attention, tied or untied embeddings.

Parameter names are torchtitan's (`tok_embeddings`, `attention.wq`,
`feed_forward.w1`, `attention_norm`, `norm`, `output`) except that the layers
are `blocks`, the harness's FSDP and compile unit. Rotary embeddings rotate
the two halves of each head (Hugging Face's `rotate_half`), not interleaved
pairs (Meta's complex form), so Hugging Face weights map by name alone, with
no permutation of `wq` and `wk` (tests/test_data_models.py checks the logits
against `transformers.LlamaForCausalLM`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.models.arguments import nearest_divisor, require_positive, require_probability
from harness.models.loss import lm_loss


def ffn_hidden_size(d_model: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4 * d_model (three matrices cost what two of 4x would),
    times `ffn_dim_multiplier`, rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


# Llama 3.1's RoPE scaling (transformers' rope_type "llama3"): the keys of config.json's rope_scaling
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, device: torch.device) -> torch.Tensor:
    """Each channel pair's rotation per position, (head_dim / 2,) in float32. With Llama 3.1's
    `scaling`, wavelengths longer than original_max_position_embeddings / low_freq_factor turn
    `factor` times slower, those shorter than original / high_freq_factor stay, and those between
    are interpolated: transformers' `_compute_llama3_parameters`, operation for operation, so the
    logits match theirs to float32 rounding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = (scaling[k] for k in LLAMA3_SCALING_KEYS)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, scaling: dict | None, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """cos and sin of each position's angles, (seq_len, head_dim), in float32; computed per
    forward (a few kFLOPs), so no buffer has to survive the meta-device build or meet FSDP2 and DCP."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def check_rope_scaling(scaling: dict | None) -> dict | None:
    """`model.rope_scaling` as transformers' config.json spells it (rope_type llama3 and its four
    keys), or null for none; ValueError naming the key, the value and the fix otherwise."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(
            f"model.rope_scaling={scaling!r} is not a mapping. Fix: model.rope_scaling=null, or Llama 3.1's "
            "{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
            "original_max_position_embeddings: 8192}."
        )
    kind = scaling.get("rope_type")
    if kind != "llama3":
        raise ValueError(
            f"model.rope_scaling.rope_type={kind!r}: model=llama computes Llama 3.1's RoPE scaling "
            "(rope_type llama3) only. Fix: model=hf model.config=<the checkpoint's directory> (transformers "
            "computes every rope type: yarn, dynamic, linear, longrope, ...), or model.rope_scaling=null."
        )
    missing = [k for k in LLAMA3_SCALING_KEYS if k not in scaling]
    unknown = sorted(set(scaling) - {"rope_type", *LLAMA3_SCALING_KEYS})
    if missing or unknown:
        raise ValueError(
            f"model.rope_scaling={scaling!r} "
            + (f"lacks {', '.join(missing)}" if missing else f"has keys llama3 scaling does not take: {unknown}")
            + f". Fix: give exactly rope_type: llama3 and {', '.join(LLAMA3_SCALING_KEYS)} "
            "(Llama 3.1: 8.0, 1.0, 4.0, 8192; Llama 3.2: 32.0, 1.0, 4.0, 8192)."
        )
    values = {k: scaling[k] for k in LLAMA3_SCALING_KEYS}
    bad = [f"model.rope_scaling.{k}={v}" for k, v in values.items() if isinstance(v, bool) or not v > 0]
    if bad or not values["high_freq_factor"] > values["low_freq_factor"]:
        raise ValueError(
            f"{', '.join(bad) or 'model.rope_scaling'}: the factors and original_max_position_embeddings must "
            "be positive and high_freq_factor above low_freq_factor "
            f"(given {values['low_freq_factor']} and {values['high_freq_factor']}). "
            "Fix: Llama 3.1's values: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, "
            "original_max_position_embeddings 8192."
        )
    return {"rope_type": "llama3", **values}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, heads, seq, head_dim) `x`: channel i pairs with i + head_dim / 2."""
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.dropout = n_heads, n_kv_heads, d_model // n_heads, dropout
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotate(self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = rotate(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.n_kv_heads < self.n_heads:
            # each key/value head serves n_heads / n_kv_heads consecutive query heads; repeated
            # rather than SDPA's enable_gqa, so CUDA can pick its flash and efficient kernels
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.residual_dropout(self.wo(y.transpose(1, 2).reshape(b, t, -1)))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class LlamaBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, hidden: int, norm_eps: float, dropout: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.attention = Attention(d_model, n_heads, n_kv_heads, dropout)
        self.ffn_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.feed_forward = FeedForward(d_model, hidden, dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama 3 decoder; attention and residual dropout as GPT's. `n_kv_heads`
    null means one key/value head per query head (no grouping); `rope_scaling`
    is Llama 3.1's (config.json's dict, rope_type llama3), null for none.
    Rotary positions need no table: `max_position_embeddings` (else `seq_len`)
    is only the context length the exported config.json records."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layer: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        intermediate_size: int | None = None,
        norm_eps: float = 1e-5,
        rope_theta: float = 500000.0,
        rope_scaling: dict | None = None,
        tie_embeddings: bool = False,
        dropout: float = 0.0,
        max_position_embeddings: int | None = None,
        seq_len: int | None = None,
    ):
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        require_positive(
            vocab_size=vocab_size,
            d_model=d_model,
            n_layer=n_layer,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            multiple_of=multiple_of,
        )
        require_probability(dropout)
        scales = {"ffn_dim_multiplier": ffn_dim_multiplier, "norm_eps": norm_eps, "rope_theta": rope_theta}
        scales.update(intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings)
        for key, value in scales.items():
            if value is not None and not value > 0:
                raise ValueError(f"model.{key}={value} must be positive. Fix: set model.{key} to a positive number.")
        check_heads(d_model, n_heads, n_kv_heads)
        rope_scaling = check_rope_scaling(rope_scaling)
        super().__init__()
        self.head_dim, self.rope_theta, self.tie_embeddings = d_model // n_heads, rope_theta, tie_embeddings
        self.rope_scaling, self.max_position_embeddings = rope_scaling, max_position_embeddings or seq_len
        hidden = intermediate_size or ffn_hidden_size(d_model, multiple_of, ffn_dim_multiplier)
        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            LlamaBlock(d_model, n_heads, n_kv_heads, hidden, norm_eps, dropout) for _ in range(n_layer)
        )
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's count: 6 per parameter outside
        the embedding table (norm weights included) plus causal attention's
        12 * layers * heads * head_dim * seq_len. A tied table is the output
        projection too, a matmul, so it counts then (torchtitan's formula, which
        subtracts the table, would drop it)."""
        weights = sum(p.numel() for p in self.parameters())
        if not self.tie_embeddings:
            weights -= self.tok_embeddings.weight.numel()
        return 6 * weights + 12 * len(self.blocks) * self.norm.normalized_shape[0] * seq_len

    def hf_names(self) -> dict[str, str]:
        """Each parameter's name in transformers' LlamaForCausalLM (a tied table once, as the embedding)."""
        return {fqn: hf_name(fqn) for fqn, _ in self.named_parameters()}

    def hf_config(self) -> dict:
        """The config.json of the same model in transformers (LlamaConfig's keys)."""
        attention = self.blocks[0].attention
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.tok_embeddings.num_embeddings,
            "hidden_size": self.tok_embeddings.embedding_dim,
            "intermediate_size": self.blocks[0].feed_forward.w1.out_features,
            "num_hidden_layers": len(self.blocks),
            "num_attention_heads": attention.n_heads,
            "num_key_value_heads": attention.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm.eps,
            **({"max_position_embeddings": self.max_position_embeddings} if self.max_position_embeddings else {}),
            "rope_parameters": {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_embeddings,
            "attention_dropout": attention.dropout,
            "attention_bias": False,
            "mlp_bias": False,
            "dtype": "float32",
        }

    def initial_value(self, fqn: str, module: nn.Module, shape: tuple, generator: torch.Generator) -> torch.Tensor:
        """torchtitan's Llama init: norms 1; the embedding table N(0, 1); the
        output projection truncated N(0, d_model^-1/2) at 3 std, and so is a
        table tied to it (it makes the logits); in block i, wq, wk, wv and w1
        truncated N(0, 0.02), and wo, w2, w3 N(0, 0.02 / sqrt(2 (i + 1)))
        (torchtitan's depth_init)."""
        if isinstance(module, nn.RMSNorm):
            return torch.ones(shape)
        value = torch.empty(shape)
        if fqn == "output.weight" or (fqn == "tok_embeddings.weight" and self.tie_embeddings):
            std = self.norm.normalized_shape[0] ** -0.5
            return nn.init.trunc_normal_(value, std=std, a=-3 * std, b=3 * std, generator=generator)
        if fqn == "tok_embeddings.weight":
            return value.normal_(generator=generator)
        block = int(fqn.split(".")[1])
        projects_out = fqn.rpartition(".")[0].endswith(("wo", "w2", "w3"))
        std = 0.02 / math.sqrt(2 * (block + 1)) if projects_out else 0.02
        return nn.init.trunc_normal_(value, std=std, generator=generator)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_cos_sin(tokens.shape[1], self.head_dim, self.rope_theta, self.rope_scaling, tokens.device)
        x = self.tok_embeddings(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output_loss(x, targets)

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The tail after the blocks: final norm, output projection and the mean cross-entropy in fp32."""
        return lm_loss(self.output(self.norm(x)), targets)


def keys_from_hf_config(hf, init_from: str) -> dict:
    """model=llama's architecture keys from transformers config `hf` (read from `init_from`'s
    config.json); ValueError with the fix `model=hf` for what model=llama does not compute."""
    key = f"model.init_from={init_from!r}"
    if hf.model_type != "llama":
        raise ValueError(
            f"{key}: its config.json is a {type(hf).__name__} (model_type={hf.model_type!r}), not a Llama. "
            f"Fix: model=hf model.init_from={init_from} (any transformers causal LM)."
        )
    rope = dict(hf.rope_parameters)
    theta, kind = rope.pop("rope_theta"), rope.get("rope_type", "default")
    unsupported = {
        "hidden_act": (hf.hidden_act, "silu"),
        "attention_bias": (hf.attention_bias, False),
        "mlp_bias": (hf.mlp_bias, False),
        "head_dim": (hf.head_dim, hf.hidden_size // hf.num_attention_heads),
        "rope_type": (kind, "default or llama3"),
        "partial_rotary_factor": (rope.pop("partial_rotary_factor", 1.0), 1.0),
    }
    for name, (value, ours) in unsupported.items():
        if value != ours and not (name == "rope_type" and kind in ("default", "llama3")):
            raise ValueError(
                f"{key}: its config.json has {name}={value!r}, and model=llama computes {name}={ours} only. "
                f"Fix: model=hf model.init_from={init_from} (transformers computes it)."
            )
    return {
        "vocab_size": hf.vocab_size,
        "d_model": hf.hidden_size,
        "n_layer": hf.num_hidden_layers,
        "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_key_value_heads,
        "intermediate_size": hf.intermediate_size,
        "norm_eps": hf.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope if kind == "llama3" else None,
        "tie_embeddings": hf.tie_word_embeddings,
        "max_position_embeddings": hf.max_position_embeddings,
    }


HF_NAMES = [  # our name's parts as transformers' LlamaForCausalLM spells them
    ("tok_embeddings", "model.embed_tokens"),
    ("blocks.", "model.layers."),
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("feed_forward.w1", "mlp.gate_proj"),
    ("feed_forward.w2", "mlp.down_proj"),
    ("feed_forward.w3", "mlp.up_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("output", "lm_head"),
]


def hf_name(fqn: str) -> str:
    """A Llama parameter's name in transformers' LlamaForCausalLM."""
    for ours, theirs in HF_NAMES:
        fqn = fqn.replace(ours, theirs)
    return "model.norm.weight" if fqn == "norm.weight" else fqn


def check_heads(d_model: int, n_heads: int, n_kv_heads: int) -> None:
    """Heads split d_model evenly, key/value heads split the query heads evenly,
    and a head's width is even (rotary embeddings rotate channel pairs)."""
    if d_model % n_heads:
        raise ValueError(
            f"model.d_model={d_model} is not divisible by model.n_heads={n_heads}. "
            f"Fix: pick n_heads dividing d_model, e.g. model.n_heads={nearest_divisor(d_model, n_heads)}."
        )
    if n_heads % n_kv_heads:
        raise ValueError(
            f"model.n_heads={n_heads} is not divisible by model.n_kv_heads={n_kv_heads}: in grouped-query "
            "attention each key/value head serves the same number of query heads. "
            f"Fix: model.n_kv_heads={nearest_divisor(n_heads, n_kv_heads)}, or null for one per query head."
        )
    head_dim = d_model // n_heads
    if head_dim % 2:
        raise ValueError(
            f"model.d_model={d_model} / model.n_heads={n_heads} gives heads {head_dim} wide, an odd width: rotary "
            "position embeddings rotate pairs of channels. "
            f"Fix: an even d_model / n_heads, e.g. model.d_model={n_heads * (head_dim + 1)}."
        )
