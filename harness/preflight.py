"""Checks that touch the file system, run once before any rank starts (after
`validate`): the data source's files, the checkpoint the run would resume
from, a checkpoint directory it can write, and the weights `model.init_from`
names. Each error names the key, the
value and the fix, like `validate`'s."""

from __future__ import annotations

import tempfile
from pathlib import Path

from omegaconf import DictConfig

from harness.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    complete_checkpoints,
    read_meta,
)
from harness.checkpoint_paths import group_checkpoints
from harness.data import data_source
from harness.models import build_model
from harness.models.hf_weights import init_from_errors
from harness.resume import check_compatible


def preflight(cfg: DictConfig, run_dir: Path, resume_from: Path | None) -> list[str]:
    """`resume_from`: the checkpoint the run's plan resumes from (`RunPlan.resume_from`)."""
    source = data_source(cfg)
    checks = getattr(source, "preflight_errors", None)
    errors = checks(cfg.train.seq_len + 1, cfg.train.eval_every > 0) if checks is not None else []
    errors += _check_checkpoint_dir(cfg.checkpoint, run_dir) + _check_resume(cfg, run_dir, resume_from)
    return errors + _check_init_from(cfg, resume_from)


def _check_init_from(cfg: DictConfig, resume_from: Path | None) -> list[str]:
    """The weights `model.init_from` names fit the model (a resume does not read them)."""
    if cfg.model.get("init_from") is None or resume_from is not None:
        return []
    return init_from_errors(build_model(cfg.model, cfg.train.seq_len), cfg.model.init_from)


def _check_checkpoint_dir(cfg: DictConfig, run_dir: Path) -> list[str]:
    """A run that cannot save would otherwise train until its first save and lose every step."""
    if cfg.mode == "none" or not cfg.dir:
        return []  # <run dir>/checkpoints: the run dir is checked before Hydra creates it
    root = checkpoint_dir(cfg, run_dir)
    existing = next(p for p in (root, *root.parents) if p.exists())
    try:  # a real write: permission bits say nothing to root, nor about read-only or virtual file systems
        tempfile.TemporaryDirectory(dir=existing, prefix=".harness-preflight-").cleanup()
        return []
    except OSError as e:
        reason = e.strerror or type(e).__name__
    return [
        f"checkpoint.dir={cfg.dir!r} cannot be created or written: {existing} refuses new entries ({reason}). "
        "Fix: checkpoint.dir=<a folder you can write to>, or checkpoint.dir=null for <run dir>/checkpoints."
    ]


def _check_resume(cfg: DictConfig, run_dir: Path, path: Path | None) -> list[str]:
    """The checkpoint `checkpoint.resume` picks (`path`) must exist, be complete and fit
    this model; and a run must not write over checkpoints it did not resume from."""
    root = checkpoint_dir(cfg.checkpoint, run_dir)
    existing = complete_checkpoints(root)
    groups = [p for done in group_checkpoints(cfg.checkpoint, run_dir).values() for p in done]
    if path is None:  # a fresh start: next to no checkpoints of any layout (resume=auto would have found them)
        if (existing or groups) and cfg.checkpoint.mode != "none":
            held = [f"{root} already holds checkpoints ({', '.join(p.name for p in existing)})"] if existing else []
            if groups:
                names = ", ".join(str(p.relative_to(run_dir) if p.is_relative_to(run_dir) else p) for p in groups)
                held.append(f"its replica groups (fault_tolerance=torchft) hold checkpoints ({names})")
            return [
                f"checkpoint.resume={cfg.checkpoint.resume} but {'; '.join(held)}; this run would write over them "
                "or start over next to them. Fix: checkpoint.resume=auto to continue from the latest, whichever "
                "layout saved it, or a new hydra.run.dir / checkpoint.dir."
            ]
        return []
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        return [str(e)]
    errors = check_compatible(meta, cfg, path)
    newer = [p.name for p in existing if int(p.name.split("_")[1]) > meta["step"]]
    if newer and cfg.checkpoint.mode != "none":
        errors.append(
            f"checkpoint.resume={str(path)!r} is step {meta['step']}, but {root} already holds later "
            f"checkpoints ({', '.join(newer)}) that this run would write over. Fix: resume from the latest "
            "(checkpoint.resume=auto), or save elsewhere (checkpoint.dir=<new folder>)."
        )
    return errors
