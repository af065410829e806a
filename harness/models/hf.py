"""Any Hugging Face `transformers` causal LM, built from its config and trained
by the harness's loop (`model=hf`).

The config comes from a local directory holding a `config.json` (`config`), or
from `model_type` with transformers' defaults, through `AutoConfig`; either way
`config_overrides` replace single keys (as `run_clm.py`'s `--config_overrides`
do) and `vocab_size` is the harness's. The blocks FSDP2 wraps, checkpoints and
compiles are the modules the class lists in `_no_split_modules` (its decoder
layers), found in the model, not at a hard-coded path.

Parameter names are transformers' own (`model.layers.0.self_attn.q_proj.weight`):
the wrapper registers the model's children as its own, so checkpoints,
`model.init_from` and `harness.export` need no name map.
"""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.nn as nn

from harness.models.loss import lm_loss

MISSING = (
    "model=hf needs Hugging Face transformers, which is not installed. "
    'Fix: pip install -e ".[hf]" (or pip install "transformers>=5,<6").'
)


def read_config(path: str, key: str, **overrides):
    """The transformers config in directory `path`'s config.json (plus `overrides`), as `from_pretrained`
    reads it; ValueError naming `key` (the model key that names the directory) when it holds no causal LM."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ValueError(MISSING) from None
    file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(file):
        raise ValueError(
            f"{key}={path!r} holds no config.json, which says what model the directory holds. Fix: point {key} "
            "at a local directory of a Hugging Face model (the one save_pretrained writes: config.json and "
            "*.safetensors)."
        )
    try:
        with open(file) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(
            f"{key}={path!r}: its config.json is not a JSON object ({type(e).__name__}: {e}). "
            "Fix: restore the file from the model's source, or write it again with save_pretrained."
        ) from None
    try:
        import transformers

        hf = AutoConfig.from_pretrained(os.path.expanduser(path), **overrides)
    except ValueError:
        raise ValueError(
            f"{key}={path!r}: its config.json has model_type={model_type!r}, which transformers "
            f"{transformers.__version__} does not know. Fix: a checkpoint of a model type transformers "
            "knows (its CONFIG_MAPPING keys: llama, qwen2, gemma, ...), or a transformers release that has it."
        ) from None
    if hf.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{key}={path!r}: its config.json is a {type(hf).__name__} (model_type={hf.model_type!r}), which has "
            "no causal LM class in transformers (AutoModelForCausalLM cannot build it), and the harness trains "
            "next-token prediction. Fix: a causal LM's checkpoint (Llama, Qwen2, Gemma, ...)."
        )
    return hf


def hf_config(config: str | None, model_type: str | None, overrides: dict, vocab_size: int):
    """The `transformers` config `model=hf` describes; ValueError naming the key when it cannot be had."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        raise ValueError(MISSING) from None
    if config is not None:
        hf = read_config(config, "model.config", **overrides)
        if hf.get_text_config().vocab_size != vocab_size:
            raise ValueError(
                f"model.vocab_size={vocab_size} differs from {config}/config.json's vocab_size="
                f"{hf.get_text_config().vocab_size}. Fix: model.vocab_size={hf.get_text_config().vocab_size}, "
                "or model.config_overrides.vocab_size to train another vocabulary from scratch."
            )
        return hf
    if model_type not in CONFIG_MAPPING:
        common = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "olmo2")
        known = ", ".join(k for k in common if k in CONFIG_MAPPING)
        raise ValueError(
            f"model.model_type={model_type!r} is not a model type transformers knows. "
            f"Fix: model.model_type= one of transformers' CONFIG_MAPPING keys, e.g. {known}; "
            "or model.config=<dir with config.json>."
        )
    return AutoConfig.for_model(model_type, **{"vocab_size": vocab_size, **overrides})


def check_override_keys(hf, overrides: dict) -> None:
    """transformers sets any keyword as an attribute, so a misspelt override would be silently
    unused: each must be a key of the config's class (its defaults, or an alias it maps)."""
    from harness.overrides import closest

    known = sorted({*type(hf)().to_dict(), *type(hf).attribute_map})
    for key in overrides:
        if key not in known:
            typo = closest(key, known)
            fix = f"model.config_overrides.{typo}=... (the closest key)" if typo else "one of its keys"
            raise ValueError(
                f"model.config_overrides.{key}: {type(hf).__name__} has no key {key!r}, so transformers would "
                f"set it and no model would read it. Fix: {fix}; its keys are config.json's."
            )


class HFCausalLM(nn.Module):
    """A `transformers` causal LM with the harness's model protocol (see
    harness/models/__init__.py). `seq_len` must fit the model's positions."""

    def __init__(
        self,
        vocab_size: int,
        config: str | None = None,
        model_type: str | None = "llama",
        config_overrides: dict | None = None,
        seq_len: int | None = None,
    ):
        overrides = dict(config_overrides or {})
        if "vocab_size" in overrides and config is None:
            raise ValueError(
                "model.config_overrides.vocab_size is set: the vocabulary is model.vocab_size, which the data "
                "reads too. Fix: set model.vocab_size instead."
            )
        hf = hf_config(config, model_type, overrides, vocab_size)
        check_override_keys(hf, overrides)
        hf._attn_implementation = "sdpa"  # CUDA picks flash / efficient kernels, as for the harness's models
        positions = getattr(hf.get_text_config(), "max_position_embeddings", None)
        if seq_len is not None and positions is not None and seq_len > positions:
            # a model from a config.json (a pretrained one, an export: model.init_from) has weights made for its
            # positions, a learned position table among them: only a model built afresh may take more
            more = f", or model.config_overrides.max_position_embeddings={seq_len}" if config is None else ""
            raise ValueError(
                f"train.seq_len={seq_len} is longer than the model's max_position_embeddings={positions}. "
                f"Fix: train.seq_len={positions} or less{more}."
            )
        from transformers import AutoModelForCausalLM

        from harness.float8 import torchao_quieted

        super().__init__()
        with torchao_quieted():  # transformers imports torchao where it is installed
            causal_lm = AutoModelForCausalLM.from_config(hf)
        # Held outside the module tree: its children are registered here as ours, so
        # parameter names are transformers' own, and its forward runs on them.
        object.__setattr__(self, "causal_lm", causal_lm)
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        split = set(causal_lm._no_split_modules or ())
        self.blocks = [m for m in causal_lm.modules() if type(m).__name__ in split]
        if not self.blocks:
            raise ValueError(
                f"model.model_type={hf.model_type!r}: {type(causal_lm).__name__} lists no decoder layers in "
                "_no_split_modules, so the harness cannot find the blocks FSDP2 wraps. "
                "Fix: pick another model type, or write the model as a harness model (docs/models.md)."
            )

    @property
    def config(self):
        """The `transformers` config (what `harness.export` writes as config.json)."""
        return self.causal_lm.config

    def hf_names(self) -> dict[str, str]:
        """Parameter names are transformers' own (a tied table once, under its first name)."""
        return {fqn: fqn for fqn, _ in self.named_parameters()}

    def hf_config(self) -> dict:
        config = json.loads(self.config.to_json_string(use_diff=False))
        return {**config, "architectures": [type(self.causal_lm).__name__]}

    def train(self, mode: bool = True) -> HFCausalLM:
        self.causal_lm.training = mode  # its own forward reads the flag; its children follow nn.Module.train
        return super().train(mode)

    def flops_per_token(self, seq_len: int) -> float:
        """The harness's count (as for Llama): 6 per parameter outside the input
        embedding table (the table counts when it is also the output projection)
        plus causal attention's 12 * layers * hidden size * seq_len."""
        text = self.config.get_text_config()
        weights = sum(p.numel() for p in self.parameters())
        table = self.causal_lm.get_input_embeddings().weight
        output = self.causal_lm.get_output_embeddings()
        if output is None or output.weight is not table:
            weights -= table.numel()
        return 6 * weights + 12 * text.num_hidden_layers * text.hidden_size * seq_len

    def initial_value(self, fqn: str, module: nn.Module, shape: tuple, generator: torch.Generator) -> torch.Tensor:
        """What the model's own `_init_weights` gives this parameter, drawn from
        `generator`'s seed: a stand-in for the owning module, holding plain CPU
        tensors of the full shapes (the module's own may be FSDP2 shards), is
        initialised on its own with the global RNG forked and seeded, so the
        value depends neither on the layout nor on the other parameters."""
        owner = self.initialised_stand_in(module, generator.initial_seed())
        return owner._parameters[fqn.rpartition(".")[2]].detach()

    def initialised_stand_in(self, module: nn.Module, seed: int) -> nn.Module:
        """A copy of `module` (its attributes - padding_idx, eps, ... - and class, for `_init_weights`)
        without children, holding new CPU tensors of its parameters' and buffers' shapes, initialised
        by `_init_weights` from `seed`."""
        owner = copy.copy(module)
        params = module._parameters.items()
        owner._parameters = {n: p if p is None else nn.Parameter(torch.empty(p.shape)) for n, p in params}
        owner._buffers = {
            n: b if b is None else torch.empty(b.shape, dtype=b.dtype) for n, b in module._buffers.items()
        }
        owner._modules = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.causal_lm._init_weights(owner)
        return owner

    @torch.no_grad()
    def initialize_buffers(self) -> None:
        """Buffers `materialize` leaves empty (rotary frequencies, Gemma's embedding scale, ...):
        computed, not drawn, so every rank gets the same values. `_init_weights` sets them: on the
        module itself when it holds no parameters, else on a stand-in (`_init_weights` would draw
        its parameters again), whose buffers are copied in."""
        for module in self.modules():
            if not any(True for _ in module.buffers(recurse=False)):
                continue
            if not any(True for _ in module.parameters(recurse=False)):
                self.causal_lm._init_weights(module)
                continue
            owner = self.initialised_stand_in(module, 0)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    buffer.copy_(owner._buffers[name])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.causal_lm(input_ids=tokens, use_cache=False).logits, targets)
