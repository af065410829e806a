"""The harness run the way train.py runs it, for the benches: `compose` a config
with Hydra's compose API, `check` it (`validate` + `plan_run`), `launch` its
ranks with the harness's own launcher (`start_local_ranks`), and in a rank
`rank_env` (process group, seeded RNG, logging); the job itself is then
`harness.job.build_job` + `harness.loop.Trainer`, as in `run_rank`.

A bench script is run as `python bench/<name>.py`, which puts bench/ on the
path, so the scripts import this module as `harness_runs`; a rank function
lives in the bench script (fork inherits it; spawn, for CUDA ranks, re-imports
the script as multiprocessing's main module).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from harness.config import ConfigError, Strategy, register_configs
from harness.dist import DistEnv, init_distributed, teardown, visible_gpus
from harness.launch import exit_now_when_done, setup_logging, start_local_ranks
from harness.plan import RunPlan, plan_run
from harness.rng import seed_rank
from harness.validate import validate

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
FSDP2_STRATEGIES = [s.value for s in Strategy if s is not Strategy.ddp]  # every layout but ddp is FSDP2
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"


def script_name() -> str:
    return f"bench/{Path(sys.argv[0]).name}"


def compose(overrides: list[str]) -> DictConfig:
    """conf/config.yaml with `overrides`, as Hydra composes it for train.py (no `hydra` key)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def check(cfg: DictConfig, world_size: int, run_dir: Path) -> RunPlan:
    """`validate` the config for `world_size` local ranks and plan the run; a config
    that cannot run ends the bench with the harness's own message."""
    try:
        validate(cfg, world_size, visible_gpus(), world_size)
    except ConfigError as e:
        raise SystemExit(f"{script_name()}: the config cannot run:\n\n{e}") from None
    return plan_run(cfg, world_size, world_size, run_dir)


def launch(cfg: DictConfig, run_dir: Path, plan: RunPlan, rank_fn: Callable, *args) -> None:
    """Run `rank_fn(cfg, run_dir, plan, *args)` on the plan's ranks, started by the
    harness's launcher (fork; spawn for CUDA ranks), or in this process for one
    rank, as train.py does; a failure ends the bench."""
    if plan.world_size == 1:
        rank_fn(cfg, run_dir, plan, *args)
        return
    failure = start_local_ranks(cfg, run_dir, plan, entrypoint=functools.partial(_rank_main, rank_fn, args))
    if failure is not None:
        raise SystemExit(f"{script_name()}: the ranks failed: {failure} (rank logs: {run_dir}/logs/)")


def _rank_main(rank_fn: Callable, args: tuple, cfg: DictConfig, run_dir: Path, plan: RunPlan) -> None:
    """A started rank, leaving as the harness's own ranks do."""
    with exit_now_when_done():
        rank_fn(cfg, run_dir, plan, *args)


@contextmanager
def rank_env(cfg: DictConfig, run_dir: Path) -> Iterator[DistEnv]:
    """This rank's process group, seeded RNG and logging (as `run_rank` and the
    launcher set them up), torn down at the end."""
    setup_logging(run_dir, int(os.environ.get("RANK", 0)))
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    seed_rank(cfg.train.seed, env.rank)
    try:
        yield env
    finally:
        teardown()
