"""Helpers the tests share: run the real CLI (`python train.py` / `torchrun`) in a temp dir, read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
# Small and fast, but the real code path: tiny MLP LM, few steps, no W&B unless a test asks.
# Checkpoint tests: the tiny MLP LM, logging every step.
SMALL = ["model=mlp", "train.batch_size=4", "train.seq_len=16", "train.log_every=1"]
FAST = ["model=mlp", "train.steps=8", "train.batch_size=4", "train.seq_len=16", "train.log_every=1"]


def base_env(tmp_path: Path) -> dict:
    """The caller's environment minus anything that would make a child think it is a torchrun rank."""
    env = dict(os.environ)
    env.update(
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
        WANDB_CACHE_DIR=str(tmp_path / ".wandb_cache"),
        WANDB_CONFIG_DIR=str(tmp_path / ".wandb_config"),
        WANDB_DATA_DIR=str(tmp_path / ".wandb_data"),
        PYTHONUNBUFFERED="1",
        HYDRA_FULL_ERROR="0",
    )
    env.pop("HARNESS_RUN_STAMP", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_cli(
    args: list[str], env: dict, cwd: Path, torchrun_nproc: int | None = None, script: Path = TRAIN, timeout: int = 240
) -> subprocess.CompletedProcess:
    if torchrun_nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun_nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            str(script),
            *args,
        ]
    else:
        cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in read_metrics(run_dir)]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    )


def steps_saved(run_dir: Path) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").iterdir()), key=lambda n: (len(n), n))


def saved_state(step_dir: Path, tmp_path: Path) -> dict:
    """Everything the checkpoint holds as one dict, read the way a user would:
    full.pt with torch.load, a DCP directory through PyTorch's own converter,
    and every rank's RNG states (`rng`) from rng.pt."""
    if (step_dir / "full.pt").exists():
        state = torch.load(step_dir / "full.pt", weights_only=True)
    else:
        # the converter behind `python -m torch.distributed.checkpoint.format_utils dcp_to_torch`,
        # called in-process: a subprocess per read cost a torch import (~4 s of CPU) each time
        out = tmp_path / f"{step_dir.parent.parent.name}_{step_dir.name}.pt"
        dcp_to_torch_save(step_dir, out)
        state = torch.load(out, weights_only=False)
    return {**state, "rng": torch.load(step_dir / "rng.pt", weights_only=True)}


def flat(tree, prefix: str = "") -> dict:
    """Leaves of nested dicts and lists by their path (`rng.0.torch`)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for key, value in items:
        if isinstance(value, dict) or (isinstance(value, list) and value and isinstance(value[0], dict)):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _lists(value):
    """Tuples as lists (a resumed optimizer's `betas` come back from disk as a list)."""
    return [_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def assert_bitwise_equal(a: dict, b: dict) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    differ = [
        k for k in fa if not (torch.equal(fa[k], fb[k]) if torch.is_tensor(fa[k]) else _lists(fa[k]) == _lists(fb[k]))
    ]
    assert not differ, f"{len(differ)} entries differ, e.g. {differ[:3]}"


def loss_by_step(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row}


def check_rank_config(cfg, run_dir, plan) -> None:
    """A rank's entrypoint for `start_local_ranks` in tests: the config arrived
    typed (enums, not strings) and in struct mode (a misspelled key raises)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError

    from harness.config import CheckpointMode

    assert OmegaConf.is_struct(cfg), "the rank's config is not in struct mode"
    assert isinstance(cfg.checkpoint.mode, CheckpointMode), f"checkpoint.mode is a {type(cfg.checkpoint.mode)}"
    try:
        cfg.train.stepz  # noqa: B018
    except ConfigAttributeError:
        return
    raise AssertionError("reading the misspelled cfg.train.stepz did not fail")
