"""The body of `train.py`'s Hydra entry point: `start`."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from harness import fault_tolerance
from harness.config import ConfigError
from harness.dist import under_torchrun
from harness.launch.check import check_config, local_rank_count, nothing_to_train, refuse
from harness.launch.ranks import start_local_ranks, train_or_exit
from harness.sweep import name_wandb_run, write_result

log = logging.getLogger("harness")


def start(cfg: DictConfig) -> dict | None:
    """Check the config, then train in this process (one rank, or a torchrun
    rank) or start the local ranks. A run that fails exits non-zero; a sweep
    job returns its result instead, so the sweep goes on."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return sweep_job(cfg, hydra_cfg, run_dir)
    torchrun = under_torchrun()
    rank = int(os.environ["RANK"]) if torchrun else 0
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else local_rank_count(cfg)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else world_size
    try:
        replica_id, mesh_rank = None, rank
        if torchrun and fault_tolerance.enabled(cfg):  # this torchrun is one replica group of the mesh
            replica_id, groups = fault_tolerance.torchrun_groups(cfg)
            # as a rank of the whole mesh it logs and writes .hydra/ as the launcher's would: only group 0's first
            # rank to train.log and .hydra/, the others to logs/rank<N>.log
            mesh_rank = replica_id * world_size + rank
            world_size *= groups
        plan = check_config(cfg, world_size, local_world_size, run_dir, mesh_rank)
        if replica_id is not None:
            fault_tolerance.check_group_world(plan, world_size // groups)
            plan = dataclasses.replace(plan, replica_id=replica_id)
    except ConfigError as e:
        refuse(e, world_size, rank)
        _remove_if_empty(run_dir)
        sys.exit(2)
    if done := nothing_to_train(cfg, plan):
        log.info("%s", done)
        return None
    if torchrun or world_size == 1:
        train_or_exit(cfg, run_dir, plan)
    elif fault_tolerance.enabled(cfg):
        # imported here: its module is also each group supervisor's `python -m` entry
        from harness.launch.replica_groups import start_replica_groups

        if code := start_replica_groups(cfg, run_dir, plan)[0]:
            sys.exit(code)
    elif start_local_ranks(cfg, run_dir, plan) is not None:
        sys.exit(1)


def sweep_job(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: Path) -> dict:
    """One job of `python train.py -m ...`: its own `launcher.nproc` ranks and
    process group, and a failure that stays its own (recorded in `result.json`)."""
    name = name_wandb_run(cfg, hydra_cfg)
    nproc = local_rank_count(cfg)
    try:
        plan = check_config(cfg, nproc, nproc, run_dir, rank=0)
    except ConfigError as e:
        refuse(e, nproc, rank=0)
        return write_result(run_dir, hydra_cfg, name, 2, str(e).splitlines()[0])
    if done := nothing_to_train(cfg, plan):
        log.info("job %d: %s", hydra_cfg.job.num, done)
        return write_result(run_dir, hydra_cfg, name, 0, "")
    try:
        if fault_tolerance.enabled(cfg):  # the job's own lighthouse and replica groups, as python train.py starts
            from harness.launch.replica_groups import start_replica_groups

            code, failure = start_replica_groups(cfg, run_dir, plan)
        else:
            failure = start_local_ranks(cfg, run_dir, plan)
            code = 0 if failure is None else 1
    except Exception as e:  # the launcher itself failed (rendezvous, fork): still this job's failure alone
        log.exception("job %d could not start its ranks", hydra_cfg.job.num)
        code, failure = 1, f"{type(e).__name__}: {e}"
    return write_result(run_dir, hydra_cfg, name, code, failure or "")


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run dir before the job starts; a job refused at validation leaves no trace."""
    try:
        run_dir.rmdir()
    except OSError:  # not empty (an earlier run's files) or already gone
        pass
