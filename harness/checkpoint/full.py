"""`checkpoint=full`: one file of plain, whole tensors per replica copy,
`full.pt` = {"model": FQN -> tensor, "optim": FQN-keyed state, "parts": the
stateful parts' tensors (the same on every replica, so in `full.pt` only)},
loadable with `torch.load(weights_only=True)` anywhere, torch.distributed or not."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_flatten

from harness.checkpoint.files import write_durably
from harness.checkpoint.replicas import Layout

FULL_FILE = "full.pt"


def file_name(copy_key: str | None) -> str:
    return FULL_FILE if copy_key is None else f"{copy_key}.pt"


def gather_full(state: Any, keep: bool) -> Any:
    """`state` with every tensor whole and on CPU where `keep`, None elsewhere.

    Gathers one tensor at a time (peak memory: one full tensor). PyTorch's
    `get_state_dict(full_state_dict=True, cpu_offload=True)` keeps the result on
    global rank 0 only; with diverged replicas each replica's first rank needs
    its own replica's copy.
    """
    if isinstance(state, dict):
        return {k: gather_full(v, keep) for k, v in state.items()}
    if isinstance(state, DTensor):
        if state.to_local().device.type != state.device_mesh.device_type:  # e.g. DiLoCo's outer state in host memory
            state = DTensor.from_local(
                state.to_local().to(state.device_mesh.device_type),
                state.device_mesh,
                state.placements,
                shape=state.shape,
                stride=state.stride(),
            )
        state = state.full_tensor()  # collective: every rank gathers, in the same order
    if torch.is_tensor(state):
        return state.detach().cpu() if keep else None
    return state


class FullMode:
    def stage(self, model_sd: dict, optim_sd: dict, parts_sd: dict, layout: Layout) -> dict | None:
        """The whole state on each replica leader that writes a copy (collective)."""
        keep = layout.replica_leader and (layout.replica == 0 or layout.diverged)
        payload = gather_full({"model": model_sd, "optim": optim_sd}, keep)
        parts = gather_full(parts_sd, keep and layout.replica == 0)
        if not keep:
            return None
        return {**payload, "parts": parts} if layout.replica == 0 and parts else payload

    def write(self, payload: dict | None, layout: Layout, partial: Path) -> None:
        if payload is not None:
            write_durably(payload, partial / file_name(layout.copy_key))

    def load_copy(
        self, path: Path, copy_key: str | None, model: torch.nn.Module, optim: torch.optim.Optimizer
    ) -> float:
        """Every rank maps the whole file and keeps its own slice: no broadcast, and
        the pages are shared between local ranks. Returns the set-state seconds."""
        state = torch.load(path / file_name(copy_key), map_location="cpu", mmap=True, weights_only=True)
        start = time.perf_counter()
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        # A whole optimizer state is distributed to this layout from the tensors the optimizer holds; a
        # stateless one (SGD without momentum) holds none, and torch's distribute step then fails
        # ("Expected device to be set"). Its state is its param groups alone: loaded as they are.
        stateful = any(torch.is_tensor(v) and v.dim() > 0 for v in tree_flatten(state["optim"]["state"])[0])
        set_optimizer_state_dict(model, optim, state["optim"], options=StateDictOptions(full_state_dict=stateful))
        return time.perf_counter() - start

    def load_parts(self, path: Path, parts: dict) -> None:
        """Fill `parts` (tensors in this run's layout) in place from `full.pt`."""
        _fill(parts, torch.load(path / FULL_FILE, map_location="cpu", mmap=True, weights_only=True)["parts"])


@torch.no_grad()
def _fill(target: dict, saved: dict) -> None:
    for key, value in target.items():
        if isinstance(value, dict):
            _fill(value, saved[key])
        elif isinstance(value, DTensor):  # this rank's slice of the whole tensor, no communication
            local = distribute_tensor(saved[key], value.device_mesh, value.placements, src_data_rank=None)
            value.to_local().copy_(local.to_local())
        elif torch.is_tensor(value):
            value.copy_(saved[key])
