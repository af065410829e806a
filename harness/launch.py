"""How ranks come to exist: torchrun starts them, or `python train.py` starts
`launcher.nproc` of them itself (fork, or spawn for CUDA) through torch's
elastic multiprocessing API; a sweep job does the latter and keeps its failure
to itself. Before any rank starts, the config is checked (`check_config`)."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from harness.checkpoint import CheckpointError
from harness.config import ConfigError, plain
from harness.dist import (
    agree_on_run_stamp,
    join_rendezvous,
    print_once,
    resolve_device,
    under_torchrun,
    visible_gpus,
)
from harness.loop import NonFiniteLossError, run_rank
from harness.mesh import HYBRID, mesh_shape
from harness.preflight import preflight
from harness.sweep import name_wandb_run, write_result
from harness.validate import config_warnings, validate

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
        join_rendezvous()
        if is_multirun(argv):
            print_once(
                "harness: `torchrun ... train.py -m` would run the whole sweep on every rank, and one failed "
                "job would silently pair later collectives with the wrong job. Fix: run sweeps without "
                f"torchrun, e.g. `python train.py -m ... launcher.nproc={os.environ['WORLD_SIZE']}`: each job "
                "then starts its own ranks.",
                int(os.environ["RANK"]),
            )
            exit_now(2)
        agree_on_run_stamp()


def exit_now(code: int | str | None) -> NoReturn:
    """Leave without interpreter finalization, with `code` as `sys.exit` reads it.

    At finalization the process groups torch's DeviceMesh cache still holds
    are destroyed, and a gloo worker thread then aborts the process now and
    then (SIGABRT after a complete run: about 1 in 35 torchrun runs on 2 cores;
    pytorch/pytorch#179291), so a finished run or sweep job would count as
    failed. Everything the run writes is closed by now (W&B finished, metrics
    file closed); logging and the standard streams are flushed here.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


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
        print(
            f"harness: the run dir {str(path)!r} cannot be created: {existing} is not a writable directory. "
            "Fix: hydra.run.dir=<a folder you can write to>.",
            file=sys.stderr,
        )
        sys.exit(2)


def start(cfg: DictConfig) -> dict | None:
    """The body of `train.py`'s Hydra entry point: check the config, then train
    in this process (one rank, or a torchrun rank) or start the local ranks. A
    run that fails exits non-zero; a sweep job returns its result instead, so
    the sweep goes on."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return sweep_job(cfg, hydra_cfg, run_dir)
    torchrun = under_torchrun()
    rank = int(os.environ["RANK"]) if torchrun else 0
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else local_rank_count(cfg)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else world_size
    if check_config(cfg, world_size, local_world_size, run_dir, rank) is not None:
        _remove_if_empty(run_dir)
        sys.exit(2)
    if torchrun or world_size == 1:
        train_or_exit(cfg, run_dir)
    elif start_local_ranks(cfg, run_dir, world_size) is not None:
        sys.exit(1)


def sweep_job(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: Path) -> dict:
    """One job of `python train.py -m ...`: its own `launcher.nproc` ranks and
    process group, and a failure that stays its own (recorded in `result.json`)."""
    name = name_wandb_run(cfg, hydra_cfg)
    nproc = local_rank_count(cfg)
    if (error := check_config(cfg, nproc, nproc, run_dir, rank=0)) is not None:
        return write_result(run_dir, hydra_cfg, name, 2, error.splitlines()[0])
    try:
        failure = start_local_ranks(cfg, run_dir, nproc)
    except Exception as e:  # the launcher itself failed (rendezvous, fork): still this job's failure alone
        log.exception("job %d could not start its ranks", hydra_cfg.job.num)
        failure = f"{type(e).__name__}: {e}"
    return write_result(run_dir, hydra_cfg, name, 0 if failure is None else 1, failure or "")


def local_rank_count(cfg: DictConfig) -> int:
    """`launcher.nproc`, filled in when null (so the config records it): one rank
    per visible GPU when the ranks use CUDA, else 2."""
    if cfg.launcher.nproc is None:
        gpus = visible_gpus()
        cfg.launcher.nproc = gpus if resolve_device(cfg.train.device, gpus) == "cuda" else 2
    return cfg.launcher.nproc


def start_method(cfg: DictConfig) -> str:
    """`launcher.start_method`; auto = spawn for CUDA ranks (a forked child cannot
    use CUDA once its parent has touched it, whoever did), fork otherwise."""
    if cfg.launcher.start_method != "auto":
        return str(cfg.launcher.start_method)
    return "spawn" if resolve_device(cfg.train.device, visible_gpus()) == "cuda" else "fork"


def check_config(cfg: DictConfig, world_size: int, local_world_size: int, run_dir: Path, rank: int) -> str | None:
    """Validate and preflight, fill in the replica count, and set up logging and
    `.hydra/`; the errors (already printed) when the config cannot run."""
    try:
        validate(cfg, world_size, visible_gpus(), local_world_size)
        if errors := preflight(cfg, run_dir):
            raise ConfigError("\n\n".join(errors))
    except ConfigError as e:
        print_once(f"harness: the config cannot run (world size {world_size}):\n\n{e}", rank)
        return str(e)
    if cfg.sharding.strategy in HYBRID and cfg.sharding.replicate is None:
        # the config records the replica count it ran with (one replica per node)
        cfg.sharding.replicate = mesh_shape(cfg.sharding.strategy, None, world_size, local_world_size)[0]
    setup_logging(run_dir, rank)
    if rank == 0:
        save_hydra_config(cfg, run_dir)
        for warning in config_warnings(cfg):
            log.warning("%s", warning)
    return None


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


def start_local_ranks(cfg: DictConfig, run_dir: Path, nproc: int) -> str | None:
    """Start `nproc` local ranks of this job and wait for them; what failed, in one line, or None."""
    method = start_method(cfg)
    log.info("starting %d local ranks (%s; run dir %s)", nproc, method, run_dir)
    failures = run_local_ranks(rank_entrypoint, (plain(cfg), str(run_dir)), nproc, method)
    if not failures:
        return None
    failed = ", ".join(
        f"rank {r} ({f.signal_name() if f.exitcode < 0 else f'exit {f.exitcode}'})" for r, f in sorted(failures.items())
    )
    log.error("training failed: %s; see the traceback above and %s/logs/", failed, run_dir)
    return failed + (f": {error}" if (error := last_logged_error(run_dir)) else "")


def run_local_ranks(
    entrypoint: Callable, args: tuple, nproc: int, start_method: str = "fork"
) -> dict[int, ProcessFailure]:
    """Start `nproc` ranks of `entrypoint(*args)` with torchrun's environment,
    wait, and stop the rest when one fails; the failures by rank ({} if none).

    The elastic agent (`elastic_launch`) is not used here: it forks ranks while
    its own store-server thread serves the ranks already started, and c10d
    formats every socket address with a reverse DNS lookup, so a rank forked
    while that thread held glibc's resolver lock hung forever in its own
    lookup (`python bench/launch_hangs.py`). This process has no threads that
    resolve names when it forks; rank 0 hosts the store, on a free port.
    `spawn` (for CUDA ranks) starts fresh interpreters, which inherit no locks.
    """
    port = free_port()
    envs = {
        rank: {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for rank in range(nproc)
    }
    ranks = start_processes(
        "harness",
        entrypoint,
        {rank: args for rank in range(nproc)},
        envs,
        DefaultLogsSpecs(),
        start_method=start_method,
    )
    try:
        result = ranks.wait(period=0.1)
    finally:
        ranks.close()  # on failure or Ctrl-C: no rank outlives the job
    return result.failures


def free_port() -> int:
    """A port free right now (the same small race torch's own launcher accepts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_logged_error(run_dir: Path) -> str:
    """The most recent ERROR line any rank logged in `run_dir`: why a job failed, for its summary."""
    latest = (0.0, "")
    for path in [run_dir / "train.log", *sorted((run_dir / "logs").glob("rank*.log"))]:
        if path.exists():
            errors = [
                line.split("[ERROR] - ", 1)[1]
                for line in path.read_text(errors="replace").splitlines()
                if "[ERROR] - " in line and "training failed:" not in line
            ]
            if errors:
                latest = max(latest, (path.stat().st_mtime, errors[-1][:300]))
    return latest[1]


def rank_entrypoint(cfg: dict, run_dir: str) -> None:
    """A locally started rank's process; must live in an importable module for the launcher.

    It leaves through `exit_now` like train.py. A forked rank already does
    (multiprocessing ends it with `os._exit`), but a spawned one (CUDA) ends in
    `sys.exit` and would finalize. It cannot leave here, before the launcher has
    read its return value, so it leaves from an exit handler: the last one
    registered runs first, before any object is torn down.
    """
    setup_logging(Path(run_dir), int(os.environ["RANK"]))
    code: int | str | None = 1  # an exception: multiprocessing's exit code for it
    try:
        train_or_exit(OmegaConf.create(cfg), Path(run_dir))
        code = 0
    except SystemExit as e:
        code = e.code
        raise
    finally:
        atexit.register(exit_now, code)


def train_or_exit(cfg: DictConfig, run_dir: Path) -> None:
    """`run_rank`, with the failures a user can act on reported as one message and exit 1."""
    try:
        run_rank(cfg, run_dir)
    except (CheckpointError, NonFiniteLossError) as e:
        # with its cause's traceback when it wraps one (a failed save or load), so a bug is not taken for a full disk
        log.error("%s", e, exc_info=e.__cause__ is not None)
        sys.exit(1)
    except (dist.DistError, RuntimeError) as e:
        if "timed out" not in str(e).lower():
            raise
        log.error(
            "a collective did not finish within dist.timeout_s=%d s (%s: %s): another rank stopped responding "
            "or died. Fix: find the failing rank in %s/logs/ and the launcher's output; raise dist.timeout_s "
            "if steps legitimately take longer.",
            cfg.dist.timeout_s,
            type(e).__name__,
            str(e).splitlines()[0][:200],
            run_dir,
        )
        sys.exit(1)


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
