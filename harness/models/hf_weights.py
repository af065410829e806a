"""Hugging Face safetensors checkpoints in and out, through DCP's Hugging Face
storage reader and writer (torchtitan's path): `model.init_from` reads one
into a (sharded) model, every rank only the slices its shards hold;
`harness.export` writes one with the config.json transformers loads.

A model takes part through `hf_names()` (its parameters' names in
transformers) and `hf_config()` (harness/models/__init__.py); one whose
tensors transformers lays out otherwise also gives `hf_layout()` (GPT: GPT-2's
transposed Conv1D weights, as views, so reading and writing share one map),
and one that lacks tensors transformers holds gives them as `hf_missing()`
for the export (GPT without biases: zero ones).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)
NEEDS_SAFETENSORS = 'Fix: pip install -e ".[hf]" (or pip install safetensors).'


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under transformers' names and as transformers lays them out (`hf_layout`),
    sharing storage: DCP reads into them in place."""
    params = dict(model.named_parameters())
    layout = getattr(model, "hf_layout", lambda fqn, tensor: tensor)
    return {hf: layout(fqn, params[fqn].detach()) for fqn, hf in model.hf_names().items()}


def hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `save_hf_weights` writes: `hf_state`, and what transformers holds that the model lacks (`hf_missing()`)."""
    return {**hf_state(model), **(model.hf_missing() if hasattr(model, "hf_missing") else {})}


def init_from_errors(model: nn.Module, init_from: str) -> list[str]:
    """Why `model.init_from` cannot fill `model` (built on the meta device is enough): no such
    directory, no safetensors, or a tensor the model lacks, misses or shapes otherwise (the first one)."""
    key = f"model.init_from={init_from!r}"
    if not hasattr(model, "hf_names"):
        return [
            f"{key}: model {type(model).__name__} has no Hugging Face layout to read weights into. Fix: model=gpt "
            "(a GPT-2 checkpoint), model=llama or model=hf (transformers' own class for the checkpoint), or drop "
            "model.init_from."
        ]
    path = os.path.expanduser(init_from)
    if not os.path.isdir(path):
        return [f"{key}: no such directory. Fix: point it at a local Hugging Face checkpoint (a save_pretrained dir)."]
    if not glob.glob(os.path.join(path, "*.safetensors")):
        return [
            f"{key} holds no *.safetensors files (a PyTorch .bin checkpoint, or not a checkpoint). Fix: convert it "
            "with transformers (from_pretrained, then save_pretrained(..., safe_serialization=True)), or point "
            "model.init_from at a safetensors checkpoint."
        ]
    try:
        saved = dcp.HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    except ImportError:
        return [f"{key}: reading safetensors needs the safetensors package, not installed. {NEEDS_SAFETENSORS}"]
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (a bad header), OSError
        return [
            f"{key}: {unreadable_file(path) or 'a *.safetensors file'} cannot be read as safetensors "
            f"({type(e).__name__}: {e}): cut short by an interrupted download or copy, or not a safetensors file. "
            "Fix: copy or download it again (its size should equal the source's), or write the checkpoint again "
            "with save_pretrained."
        ]
    expected = {hf: tuple(p.shape) for hf, p in hf_state(model).items()}
    for name, shape in expected.items():
        prefix, _, bare = name.partition(".")
        if name not in saved and bare in saved:
            return [
                f"{key} holds tensor {bare!r} where the model needs {name!r}: a base model's names, without the "
                f"{prefix!r} of transformers' causal LM class (as the Hugging Face Hub's gpt2 files are). Fix: write "
                "it again as the causal LM, AutoModelForCausalLM.from_pretrained(<dir>).save_pretrained(<new dir>), "
                "and point model.init_from at the new directory."
            ]
        if name not in saved:
            return [
                f"{key} has no tensor {name!r}, which the model needs (shape {list(shape)}): the checkpoint is of "
                f"another architecture or size. Fix: set model keys to the checkpoint's config.json, or point "
                "model.init_from at a checkpoint of this model."
            ]
        if tuple(saved[name].size) != shape:
            return [
                f"{key}: tensor {name!r} has shape {list(saved[name].size)}, the model's is {list(shape)}. Fix: set "
                "the model's keys to the checkpoint's config.json (e.g. model.vocab_size, the layer sizes)."
            ]
    extra = sorted(saved.keys() - expected.keys())
    if extra:
        return [
            f"{key} holds tensor {extra[0]!r} (and {len(extra) - 1} more) that the model does not have, so its "
            "weights would be dropped (e.g. an untied output projection for a tied model). Fix: set the model's "
            "keys to the checkpoint's config.json (model.tie_embeddings, ...)."
        ]
    return []


def unreadable_file(path: str) -> str | None:
    """The first *.safetensors file in `path` whose header safetensors cannot read."""
    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception:  # noqa: BLE001 - SafetensorError, OSError: this is the file
            return file
    return None


@torch.no_grad()
def load_hf_weights(model: nn.Module, init_from: str) -> None:
    """Fill `model`'s parameters from the safetensors checkpoint at `init_from`, in place,
    in any layout (collective under a process group); dtypes are converted to the parameters'."""
    path = os.path.expanduser(init_from)
    reader = dcp.HuggingFaceStorageReader(path)
    state = hf_state(model)
    dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    if not dist.is_initialized() or dist.get_rank() == 0:
        files = len(glob.glob(os.path.join(path, "*.safetensors")))
        params = sum(t.numel() for t in state.values())
        log.info(
            "model.init_from=%s: loaded %d tensors (%s parameters) from %d safetensors file(s)",
            init_from,
            len(state),
            f"{params:,}",
            files,
        )


@torch.no_grad()
def save_hf_weights(model: nn.Module, out: Path, notes: dict[str, dict | bytes] | None = None) -> None:
    """Write `model` (one process) as a Hugging Face checkpoint in `out`: safetensors through DCP's
    writer, config.json (`model.hf_config()`, unless `notes` has one), and `notes` (file name -> JSON
    content, or the file's bytes). Written into a sibling directory and renamed, so `out` is whole or absent."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    state = {hf: (t.full_tensor() if isinstance(t, DTensor) else t).contiguous() for hf, t in hf_tensors(model).items()}
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(partial)))
    for name, content in {"config.json": model.hf_config(), **(notes or {})}.items():
        data = content if isinstance(content, bytes) else (json.dumps(content, indent=2) + "\n").encode()
        (partial / name).write_bytes(data)
    for file in partial.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    os.replace(partial, out)
