"""Where a run's checkpoints are, and which one it resumes from. Outside the
checkpoint package, which loads torch.distributed and `harness.job`, so that
`harness.plan` (which `harness.job` imports) can look up the checkpoint a run
resumes from without an import cycle. Under `fault_tolerance=torchft` each
replica group keeps its own (`group_checkpoint_config`). The files inside a
checkpoint: `harness.checkpoint.files`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import DictConfig

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"  # written last: a step_<N> directory without it is not a checkpoint
GROUP_DIR = re.compile(r"^replica_group_(\d+)$")


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """Where checkpoints go: `checkpoint.dir`, or `<run dir>/checkpoints`."""
    return Path(os.path.expanduser(cfg.dir)) if cfg.dir else run_dir / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """`step_<N>` directories under `root` that hold a `meta.json`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


def resume_path(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` asks for: None (start fresh) or a `step_<N>` dir."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        done = complete_checkpoints(checkpoint_dir(cfg, run_dir))
        return done[-1] if done else None
    path = Path(os.path.expanduser(cfg.resume))
    if not (path / META).is_file():  # a checkpoints folder: its newest complete one
        done = complete_checkpoints(path)
        return done[-1] if done else path  # read_meta names what is missing
    return path


def group_dir(run_dir: Path, replica_id: int) -> Path:
    """A replica group's own outputs under fault_tolerance=torchft: metrics, W&B and TensorBoard runs, checkpoints."""
    return run_dir / f"replica_group_{replica_id}"


def group_checkpoint_config(cfg: DictConfig, replica_id: int) -> DictConfig:
    """`checkpoint` as replica group `replica_id` uses it: a group saves with its own ranks only and no
    group waits for another, so its checkpoints go to `<its group_dir>/checkpoints`, or to
    `checkpoint.dir` with the same suffix."""
    group = cfg.copy()
    if cfg.dir:
        group.dir = str(group_dir(Path(os.path.expanduser(cfg.dir)), replica_id))
    return group


def step_of(path: Path) -> int:
    """The step of a `step_<N>` checkpoint directory."""
    return int(STEP_DIR.match(path.name).group(1))


def group_checkpoints(cfg: DictConfig, run_dir: Path) -> dict[int, list[Path]]:
    """Every replica group's complete checkpoints (oldest first) under `run_dir` (fault_tolerance=torchft's
    layout), by replica id; {} for a run without replica groups."""
    root = Path(os.path.expanduser(cfg.dir)) if cfg.dir else run_dir
    groups = sorted(int(m.group(1)) for p in root.glob("replica_group_*") if (m := GROUP_DIR.match(p.name)))
    return {
        r: complete_checkpoints(checkpoint_dir(group_checkpoint_config(cfg, r), group_dir(run_dir, r))) for r in groups
    }


def groups_at_one_step(cfg: DictConfig, run_dir: Path) -> list[Path]:
    """A fault-tolerant run's one model to take, as checkpoints: every replica group's at the newest step all
    groups with checkpoints saved (an export averages them, and so does a run of one world resuming them);
    without a step in common, the furthest group's newest alone; [] without group checkpoints."""
    groups = [done for done in group_checkpoints(cfg, run_dir).values() if done]
    if not groups:
        return []
    common = set.intersection(*({step_of(p) for p in done} for done in groups))
    if not common:
        return [max((done[-1] for done in groups), key=step_of)]
    return [next(p for p in done if step_of(p) == max(common)) for done in groups]


def run_resume_path(cfg: DictConfig, run_dir: Path, replica_groups: bool) -> Path | None:
    """The checkpoint the run resumes from, for what is decided before any rank starts (nothing
    left to train, the resume warnings, the architecture). With `checkpoint.resume=auto` it is the
    run's newest whichever layout saved it: with `replica_groups` (fault_tolerance=torchft) each
    group resumes its own newest and the first quorum heals the groups behind from the furthest, so
    the run resumes where its furthest group is; a run of one world resumes its own newest, or the
    groups' at their newest common step (`groups_at_one_step`: it starts from their mean). Either
    takes the other layout's when the run dir holds only that (`group_resume_path` for a group)."""
    if cfg.resume != "auto":
        return resume_path(cfg, run_dir)
    own = resume_path(cfg, run_dir)
    if replica_groups:
        furthest = max(
            (done[-1] for done in group_checkpoints(cfg, run_dir).values() if done), key=step_of, default=None
        )
        return furthest or own
    return own or next(iter(groups_at_one_step(cfg, run_dir)), None)


def group_resume_path(cfg: DictConfig, run_dir: Path, replica_id: int) -> Path | None:
    """The checkpoint replica group `replica_id` resumes from: its own newest; when no group has
    one and `checkpoint.resume=auto`, the newest a run of one world saved in `run_dir` (every group
    starts from it); else none (the group starts fresh and the first quorum heals it)."""
    own = resume_path(group_checkpoint_config(cfg, replica_id), group_dir(run_dir, replica_id))
    if own is not None or cfg.resume != "auto" or any(group_checkpoints(cfg, run_dir).values()):
        return own
    return resume_path(cfg, run_dir)
