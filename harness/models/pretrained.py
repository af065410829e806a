"""`model.init_from=<dir>` alone is enough: the architecture comes from the
directory's config.json, as `AutoModelForCausalLM.from_pretrained(dir)` takes
it, and is written into the run's model keys before any rank starts, so the
ranks build it and `.hydra/config.yaml` records it. Model keys given on the
command line that contradict config.json are refused, naming both values.

`model=gpt` takes config.json's GPT-2 keys (`gpt.keys_from_hf_config`: the
GELU and the position table's rows included); `model=llama` takes its Llama
keys (`llama.keys_from_hf_config`); `model=hf` takes the directory as
`model.config`, with only the `config_overrides` the command line gives. A
resume takes the architecture from its checkpoint and does not read
`init_from` at all.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf, open_dict

from harness.config import ConfigError

GPT, LLAMA, HF = "harness.models.GPT", "harness.models.Llama", "harness.models.HFCausalLM"


def explicit_model_keys(overrides: list[str]) -> set[str]:
    """The model keys the command line sets (`model.d_model=64` -> `d_model`, `+model.config_overrides.x=1`
    -> `config_overrides.x`); not a group choice (`model=llama`)."""
    keys = set()
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("model."):
            keys.add(key.removeprefix("model."))
    return keys


def given(keys: set[str], name: str) -> bool:
    return any(k == name or k.startswith(f"{name}.") for k in keys)


def adopt_init_from(model: DictConfig, explicit: set[str]) -> str | None:
    """Set `model`'s architecture keys from `model.init_from`'s config.json, in place; returns what it
    read, for the log (None without init_from or for a model without Hugging Face's layout, which
    `validate` refuses). ConfigError naming key, values and fix for a config.json that cannot be had,
    describes another model, or contradicts a key given on the command line."""
    init_from, target = model.get("init_from"), model.get("_target_")
    if init_from is None or target not in (GPT, LLAMA, HF):
        return None
    key = "model.init_from"
    if not os.path.isdir(os.path.expanduser(init_from)):
        raise ConfigError(
            f"{key}={init_from!r}: no such directory. Fix: point it at a local Hugging Face checkpoint "
            "(a save_pretrained dir)."
        )
    from harness.models.hf import read_config

    try:
        hf = read_config(init_from, key)
        keys = keys_for(model, hf, init_from)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    contradictions = []
    for name, value in keys.items():
        if given(explicit, name) and model.get(name) != value:
            contradictions.append(f"model.{name}={_render(model.get(name))} (config.json: {_render(value)})")
    if target == LLAMA:
        contradictions += _width_contradictions(model, explicit, keys["intermediate_size"])
    if contradictions:
        raise ConfigError(
            f"{key}={init_from!r}: its config.json gives the architecture, and the command line contradicts it: "
            f"{'; '.join(contradictions)}. Fix: drop those model keys (init_from sets them), or point "
            f"{key} at a checkpoint of the architecture you want."
        )
    with open_dict(model):
        for name, value in keys.items():
            model[name] = value
        if target == HF:  # only the overrides the command line gives: the defaults are a debug shape
            model.config_overrides = {
                k: v for k, v in model.config_overrides.items() if given(explicit, f"config_overrides.{k}")
            }
    text = hf.get_text_config()
    return (
        f"{key}={init_from}: the architecture from its config.json: {hf.model_type}, {text.num_hidden_layers} "
        f"layers, hidden size {text.hidden_size}, {text.num_attention_heads} heads "
        f"({getattr(text, 'num_key_value_heads', None) or text.num_attention_heads} key/value), vocabulary "
        f"{text.vocab_size}"
    )


def keys_for(model: DictConfig, hf, init_from: str) -> dict:
    """The model keys config.json `hf` sets for `model`'s class."""
    if model._target_ == GPT:
        from harness.models.gpt import keys_from_hf_config

        return keys_from_hf_config(hf, init_from)
    if model._target_ == LLAMA:
        from harness.models.llama import keys_from_hf_config

        return keys_from_hf_config(hf, init_from)
    return {"config": init_from, "model_type": hf.model_type, "vocab_size": hf.get_text_config().vocab_size}


def _width_contradictions(model: DictConfig, explicit: set[str], width: int) -> list[str]:
    """`multiple_of` / `ffn_dim_multiplier` on the command line ask for a SwiGLU width: config.json's must be it."""
    from harness.models.llama import ffn_hidden_size

    if not (given(explicit, "multiple_of") or given(explicit, "ffn_dim_multiplier")):
        return []
    asked = ffn_hidden_size(model.d_model, model.multiple_of, model.ffn_dim_multiplier)
    if asked == width:
        return []
    return [
        f"model.multiple_of={model.multiple_of} and model.ffn_dim_multiplier={model.ffn_dim_multiplier} give a "
        f"SwiGLU width of {asked} (config.json: intermediate_size={width})"
    ]


def adopt_saved_architecture(model: DictConfig, saved: dict, explicit: set[str]) -> None:
    """A resume of a run that started from `init_from`: the architecture that run took from config.json
    is the checkpoint's (`saved`: its model keys), so `init_from` is not read (it may have moved). Keys
    the command line gives stay, for the resume's own check to compare."""
    with open_dict(model):
        for name, value in saved.items():
            if name not in ("init_from", "activation_checkpointing") and not given(explicit, name):
                model[name] = value


def _render(value) -> str:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
