"""Per-rank logging of a run."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs to stdout and `train.log`; other ranks to `logs/rank<N>.log` (warnings also to stderr)."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # a sweep sets up logging once per job
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    if rank == 0:
        handlers = [logging.StreamHandler(sys.stdout), logging.FileHandler(run_dir / "train.log")]
    else:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setLevel(logging.WARNING)
        handlers = [logging.FileHandler(run_dir / "logs" / f"rank{rank}.log"), stderr]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT if rank == 0 else f"[rank {rank}]{LOG_FORMAT}"))
        root.addHandler(handler)
