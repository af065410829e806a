"""Checkpoints: `checkpoint=full` or `sharded` (+ `async`); see `files` for the
on-disk format, `replicas` for diverged replicas, `checkpointer` for saving
and loading."""

from harness.checkpoint.checkpointer import Checkpointer, load
from harness.checkpoint.files import CheckpointError, read_meta
from harness.checkpoint.full import gather_full
from harness.checkpoint.replicas import inner_optimizer
from harness.checkpoint_paths import checkpoint_dir, complete_checkpoints, resume_path

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "checkpoint_dir",
    "complete_checkpoints",
    "gather_full",
    "inner_optimizer",
    "load",
    "read_meta",
    "resume_path",
]
