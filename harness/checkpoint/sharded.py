"""`checkpoint=sharded` (+ `checkpoint.async=true`): a DCP directory, each rank
writing its own shards; loads reshard to any layout."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from harness.checkpoint.replicas import Layout
from harness.compat import ReusableStager
from harness.float8 import plain_tensors


class ShardedMode:
    def stage(self, model_sd: dict, optim_sd: dict, parts_sd: dict, layout: Layout) -> dict:
        """Each replica copy under its key; the parts' tensors (the same on every
        replica, so DCP writes them once) under `parts`."""
        payload = {"model": model_sd, "optim": optim_sd}
        payload = payload if layout.copy_key is None else {layout.copy_key: payload}
        return {**payload, "parts": parts_sd} if parts_sd else payload

    def write(self, payload: dict, layout: Layout, partial: Path) -> None:
        dcp.save(payload, checkpoint_id=str(partial))

    def load_copy(
        self, path: Path, copy_key: str | None, model: torch.nn.Module, optim: torch.optim.Optimizer
    ) -> float:
        """Read this rank's shards of one replica copy in place; returns the set-state seconds."""
        model_sd, optim_sd = plain_tensors(get_state_dict(model, optim))
        target = {"model": model_sd, "optim": optim_sd}
        dcp.load(target if copy_key is None else {copy_key: target}, checkpoint_id=str(path))
        start = time.perf_counter()
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return time.perf_counter() - start

    def load_parts(self, path: Path, parts: dict) -> None:
        """Read this rank's shards of the parts' tensors, in place."""
        dcp.load({"parts": parts}, checkpoint_id=str(path))


class AsyncShardedMode(ShardedMode):
    """`dcp.async_save`: the state is copied to host memory in a background
    thread (the loop waits for that only before the next optimizer step changes
    the parameters) and written in another; at most one save is in flight."""

    def __init__(self, device: torch.device):
        # Its own (gloo) group: on the default group the background thread's
        # collectives crash against the loop's (verified on torch 2.13), and on
        # CUDA the default group is nccl, which DCP's async path refuses.
        self.group = dist.new_group(backend="gloo")
        # One stager for every save, so its staging buffers are reused. With
        # DCP's default synchronous stager the loop was blocked 23-47 % of a
        # sync save (bench/checkpoint.py); the target is <= 10 %. On CUDA the
        # copy goes to pinned host buffers on a side stream.
        cuda = device.type == "cuda"
        self.stager = ReusableStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
            )
        )

    def start(self, payload: dict, partial: Path) -> tuple[Future, Future]:
        """Start saving; returns (staged: the host copy is complete, written: on disk)."""
        response = dcp.async_save(
            payload, checkpoint_id=str(partial), process_group=self.group, async_stager=self.stager
        )
        return response.staging_completion, response.upload_completion

    def close(self) -> None:
        self.stager.close()
