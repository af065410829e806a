"""Models: a model is an `nn.Module` class named by `model._target_`.

`build_model` builds it from its config keys plus `seq_len`, on the meta
device (no memory, no init); `materialize` gives it values after sharding, so
every rank - and a single-process reference - holds the same weights whatever
the layout. A model
- exposes its repeated layers as `blocks` (the unit FSDP wraps and
  `train.compile` compiles);
- returns the LM loss from `forward(tokens, targets)` (`loss.lm_loss`);
- may compute its tail after the blocks in `output_loss(x, targets)` (final
  norm, output projection, loss), which `train.compile` compiles with the
  blocks under FSDP2 (a quarter of a 163M GPT's GPU time eager);
- counts its training `flops_per_token(seq_len)` (for `train/mfu`);
- gives each parameter's full initial value from `initial_value(fqn, module,
  shape, generator)`, drawing only from `generator`, which `materialize` seeds
  by `train.seed` and the parameter's name;
- may compute buffers in `initialize_buffers()` (values that are computed, not
  drawn, e.g. rotary frequencies), which `materialize` calls last;
- refuses bad arguments in its constructor with a ValueError naming the key,
  the value and the fix (`validate` builds it on the meta device to ask).
A model with Hugging Face's layout also gives `hf_names()` (its parameter names
to transformers' names) and `hf_config()` (the config.json that describes it):
harness/models/hf_weights.py reads (`model.init_from`) and writes
(`harness.export`) safetensors through them. A model whose tensors transformers
lays out otherwise also gives `hf_layout(fqn, tensor)` (the parameter as
transformers holds it, a view, used both ways), and one lacking tensors
transformers holds gives them in `hf_missing()` for the export (GPT: GPT-2's
Conv1D weights are transposed, and a model without biases has zero ones).

Members: `GPT` and `TokenMLP` (gpt.py), `Llama` (llama.py), `HFCausalLM`
(hf.py: any transformers causal LM).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.models.gpt import GPT, TokenLM, TokenMLP
from harness.models.hf import HFCausalLM
from harness.models.hf_weights import load_hf_weights
from harness.models.llama import Llama
from harness.rng import seeded_generator

__all__ = [
    "GPT",
    "HARNESS_KEYS",
    "HFCausalLM",
    "Llama",
    "TokenLM",
    "TokenMLP",
    "build_model",
    "materialize",
    "parameter_count",
]

# model-group keys the harness applies to any model (harness.sharding), not arguments of the class
HARNESS_KEYS = ("activation_checkpointing", "init_from")


def build_model(cfg: DictConfig, seq_len: int) -> nn.Module:
    """The model `cfg._target_` names, on the meta device."""
    spec = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in HARNESS_KEYS}
    with torch.device("meta"):
        return instantiate(spec, _partial_=True, _convert_="all")(seq_len=seq_len)


def parameter_count(model: nn.Module) -> int:
    """What the run logs as its parameters: each one once (a tied table once), whole under any
    sharding (a DTensor's numel is the full tensor's), position tables included: nanoGPT's
    `get_num_params(non_embedding=False)` (nanoGPT prints the default, without its position table)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, init_from: str | None = None) -> None:
    """Allocate `model`'s (possibly sharded) parameters on `device` and initialise them,
    then, given `init_from` (`model.init_from`), read a Hugging Face checkpoint over them.

    Each parameter's full value comes from the model's `initial_value` with its
    own generator, seeded by `seed` and its name, so the result does not depend
    on the layout: a rank copies its local shard of that value. A tied
    parameter is initialised once, under its first name, and stays tied.
    """
    names = {}  # id -> first name, and every later name of the same parameter
    ties = [(fqn, names.setdefault(id(p), fqn)) for fqn, p in model.named_parameters(remove_duplicate=False)]
    model.to_empty(device=device)
    for fqn, first in ties:
        # to_empty gives each name a new tensor, unless FSDP2 swaps them in place
        if fqn != first and model.get_parameter(fqn) is not model.get_parameter(first):
            owner, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(owner), name, model.get_parameter(first))
    for fqn, param in model.named_parameters():
        module = model.get_submodule(fqn.rpartition(".")[0])
        generator = seeded_generator(seed, zlib.crc32(fqn.encode()))
        full = model.initial_value(fqn, module, tuple(param.shape), generator).to(device)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
    if hasattr(model, "initialize_buffers"):
        model.initialize_buffers()
    if init_from is not None:
        load_hf_weights(model, init_from)
