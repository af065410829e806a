"""A replica group's own outputs (`replica_group_<r>/`: metrics, W&B, checkpoints) and the
marker it leaves once it has trained every step, which a peer restarted after that reads."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from harness.checkpoint_paths import GROUP_DIR, group_checkpoint_config, group_dir, group_resume_path

# in a replica group's outputs once it has trained every step: a peer restarted after that finds no one
# to heal from (the lighthouse cannot tell finished groups from dead ones), so it stops instead of
# waiting quorum_timeout_s and training on alone
FINISHED = "finished.json"


def group_outputs(cfg: DictConfig, run_dir: Path, replica_id: int) -> tuple[Path, Path | None]:
    """A replica group's own outputs: `<run dir>/replica_group_<r>/` holds its metrics.jsonl,
    W&B and TensorBoard runs and checkpoints (a dead group must not stop the others' logging
    or saving); returns that directory and the checkpoint the group resumes from, and points
    `cfg.checkpoint` at the group's checkpoints."""
    run_checkpoint = cfg.checkpoint
    cfg.checkpoint = group_checkpoint_config(run_checkpoint, replica_id)
    outputs = group_dir(run_dir, replica_id)
    outputs.mkdir(exist_ok=True)
    (outputs / FINISHED).unlink(missing_ok=True)  # an earlier run's, in this run dir: this one is not finished
    return outputs, group_resume_path(run_checkpoint, run_dir, replica_id)


class PeersFinished(Exception):
    """A restarted replica group found that a peer has trained every step: there is no one left to heal
    from, and the run's model is its peers'; the group stops (and its rank exits 0)."""


def finished_step(run_dir: Path, replica_id: int) -> int | None:
    """The step replica group `replica_id` under `run_dir` finished training at, or None (not finished)."""
    try:
        return json.loads((group_dir(run_dir, replica_id) / FINISHED).read_text())["step"]
    except (OSError, ValueError, KeyError):  # not there, being written, or gone: not finished
        return None


def finished_peer(run_dir: Path, replica_id: int, steps: int) -> tuple[int, int] | None:
    """(a peer group of `replica_id` under `run_dir` that has trained `steps` steps, its step), or None."""
    for marker in sorted(run_dir.glob(f"replica_group_*/{FINISHED}")):
        group = GROUP_DIR.match(marker.parent.name)
        if group and int(group.group(1)) != replica_id:
            step = finished_step(run_dir, int(group.group(1)))
            if step is not None and step >= steps:
                return int(group.group(1)), step
    return None
