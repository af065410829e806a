"""How ranks come to exist: torchrun starts them, or `python train.py` starts
`launcher.nproc` of them itself through torch's elastic launch API."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from harness.checkpoint import CheckpointError
from harness.config import ConfigError, config_warnings, validate
from harness.dist import agree_on_run_stamp, under_torchrun
from harness.loop import NonFiniteLossError, run

log = logging.getLogger("harness")
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def prepare_torchrun_rank(argv: list[str]) -> None:
    """Before Hydra composes: agree on one run dir.

    A sweep under torchrun is refused: every rank would run the sweep, and a
    rank that fails one job moves on while its peers' collectives pair up with
    the previous job - silent corruption. `python train.py -m` starts a fresh
    group of ranks per job instead.
    """
    if under_torchrun():
        if is_multirun(argv):
            if os.environ["RANK"] == "0":
                print("harness: `torchrun ... train.py -m` would run the whole sweep on every rank, and one failed "
                      "job would silently pair later collectives with the wrong job. Fix: run sweeps without "
                      f"torchrun, e.g. `python train.py -m ... launcher.nproc={os.environ['WORLD_SIZE']}`: each job "
                      "then starts its own ranks.", file=sys.stderr)
            sys.exit(2)
        agree_on_run_stamp()


def is_multirun(argv: list[str]) -> bool:
    return any(arg in ("-m", "--multirun") for arg in argv[1:])


def refuse_unwritable_run_dir(argv: list[str]) -> None:
    """Hydra creates the run dir before any harness code runs and fails with a
    traceback when it cannot; say it in one line instead."""
    given = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("hydra.run.dir=")]
    if is_multirun(argv) or (given and "${" in given[-1]):
        return
    path = Path(given[-1] if given else "outputs").expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        print(f"harness: the run dir {str(path)!r} cannot be created: {existing} is not a writable directory. "
              "Fix: hydra.run.dir=<a folder you can write to>.", file=sys.stderr)
        sys.exit(2)


def main(cfg: DictConfig) -> None:
    """The body of `train.py`'s Hydra entry point."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    torchrun = under_torchrun()
    rank = int(os.environ["RANK"]) if torchrun else 0
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else cfg.launcher.nproc
    try:
        validate(cfg, world_size, torch.cuda.is_available(), run_dir)
    except ConfigError as e:
        if rank == 0:
            print(f"harness: the config cannot run (world size {world_size}):\n\n{e}", file=sys.stderr)
        _remove_if_empty(run_dir)
        sys.exit(2)
    setup_logging(run_dir, rank)
    if rank == 0:
        save_hydra_config(cfg, run_dir)
        for warning in config_warnings(cfg):
            log.warning("%s", warning)
    if torchrun or world_size == 1:
        run_rank(cfg, run_dir)
    else:
        launch_local(cfg, run_dir, world_size)


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run dir before the job starts; a job refused at validation leaves no trace."""
    try:
        run_dir.rmdir()
    except OSError:  # not empty (an earlier run's files) or already gone
        pass


def save_hydra_config(cfg: DictConfig, run_dir: Path) -> None:
    """`.hydra/` as Hydra writes it (config, hydra, overrides), once the config is known to run."""
    hydra_cfg = HydraConfig.get()
    out = run_dir / ".hydra"
    out.mkdir(exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, out / "overrides.yaml")


def launch_local(cfg: DictConfig, run_dir: Path, nproc: int) -> None:
    """Start `nproc` local ranks (fork, c10d rendezvous on a free port) and wait for them."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"harness-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          start_method="fork", monitor_interval=0.1)
    log.info("starting %d local ranks (run dir %s)", nproc, run_dir)
    try:
        elastic_launch(config, worker)(OmegaConf.to_container(cfg, resolve=True), str(run_dir))
    except ChildFailedError as e:
        failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(e.failures.items()))
        log.error("training failed: %s; see the traceback above and %s/logs/", failed, run_dir)
        sys.exit(1)


def worker(cfg: dict, run_dir: str) -> None:
    """One locally launched rank; must live in an importable module for the launcher."""
    setup_logging(Path(run_dir), int(os.environ["RANK"]))
    run_rank(OmegaConf.create(cfg), Path(run_dir))


def run_rank(cfg: DictConfig, run_dir: Path) -> None:
    """`run`, with the failures a user can act on reported as one message instead of a traceback."""
    try:
        run(cfg, run_dir)
    except (CheckpointError, NonFiniteLossError) as e:
        log.error("%s", e)
        sys.exit(1)
    except (dist.DistError, RuntimeError) as e:
        if "timed out" not in str(e).lower():
            raise
        log.error("a collective did not finish within dist.timeout_s=%d s (%s: %s): another rank stopped responding "
                  "or died. Fix: find the failing rank in %s/logs/ and the launcher's output; raise dist.timeout_s "
                  "if steps legitimately take longer.", cfg.dist.timeout_s, type(e).__name__,
                  str(e).splitlines()[0][:200], run_dir)
        sys.exit(1)


def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs to stdout and `train.log`; other ranks to `logs/rank<N>.log` (warnings also to stderr)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
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
