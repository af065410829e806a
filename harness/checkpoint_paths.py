"""Where a run's checkpoints are, and which one it resumes from. Outside the
checkpoint package, which loads torch.distributed and `harness.job`, so that
`harness.plan` (which `harness.job` imports) can look up the checkpoint a run
resumes from without an import cycle. The files inside a checkpoint:
`harness.checkpoint.files`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import DictConfig

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"  # written last: a step_<N> directory without it is not a checkpoint


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
