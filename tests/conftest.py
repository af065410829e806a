"""Shared helpers: run the real CLI (`python train.py` / `torchrun`) in a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
# Small and fast, but the real code path: tiny MLP LM, few steps, no W&B unless a test asks.
FAST = ["model=mlp", "train.steps=8", "train.batch_size=4", "train.seq_len=16", "train.log_every=1"]


def base_env(tmp_path: Path) -> dict:
    """The caller's environment minus anything that would make a child think it is a torchrun rank."""
    env = dict(os.environ)
    env.update(WANDB_MODE="disabled", WANDB_SILENT="true", WANDB_CACHE_DIR=str(tmp_path / ".wandb_cache"),
               WANDB_CONFIG_DIR=str(tmp_path / ".wandb_config"), WANDB_DATA_DIR=str(tmp_path / ".wandb_data"),
               PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    env.pop("HARNESS_RUN_STAMP", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.fixture
def cli_env(tmp_path):
    return base_env(tmp_path)


def run_cli(args: list[str], env: dict, cwd: Path, torchrun_nproc: int | None = None,
            script: Path = TRAIN, timeout: int = 240) -> subprocess.CompletedProcess:
    if torchrun_nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun_nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(script), *args]
    else:
        cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in read_metrics(run_dir)]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
