"""A job's local ranks: `start_local_ranks` starts `launcher.nproc` of them
(fork, or spawn for CUDA) through torch's elastic multiprocessing API and
waits; each rank runs `train_or_exit`, and a rank that fails says why in torch
elastic's error file, which the launcher (or torchrun) reads back."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from harness.checkpoint import CheckpointError
from harness.data.shards import TokenIdsOutOfRange
from harness.fault_tolerance.link import CommitUnknown, ExchangesFailed, LighthouseUnreachable
from harness.launch.check import start_method
from harness.launch.exit import exit_now_when_done, exit_on_exception, record_failure
from harness.launch.logs import setup_logging
from harness.loop import run_rank
from harness.nonfinite import NonFiniteLossError
from harness.plan import RunPlan

log = logging.getLogger("harness")


def start_local_ranks(cfg: DictConfig, run_dir: Path, plan: RunPlan, entrypoint: Callable | None = None) -> str | None:
    """Start the plan's ranks of this job, each running `entrypoint(cfg, run_dir,
    plan)` (`rank_entrypoint`: train; a bench brings its own), and wait for
    them; what failed, in one line, or None.

    The ranks get `cfg` itself, typed and in struct mode as Hydra composed it
    (a misspelled key read in a rank fails there as it would here), its
    interpolations resolved (Hydra's resolvers exist only in this process)."""
    method = start_method(cfg)
    log.info("starting %d local ranks (%s; run dir %s)", plan.world_size, method, run_dir)
    OmegaConf.resolve(cfg)
    failures = run_local_ranks(
        entrypoint or rank_entrypoint, (cfg, run_dir, plan), plan.world_size, method, scratch=run_dir / "logs"
    )
    if not failures:
        return None
    summary = failure_summary(failures)
    log.error("training failed: %s; see %s/train.log and %s/logs/", summary, run_dir, run_dir)
    return summary


def failure_summary(failures: dict[int, ProcessFailure]) -> str:
    """`rank 1 (exit 1), rank 0 (SIGKILL): <why>`, the reason being the first
    failure a rank recorded (the others usually fail because that rank left)."""
    ranks = ", ".join(
        f"rank {r} ({f.signal_name() if f.exitcode < 0 else f'exit {f.exitcode}'})" for r, f in sorted(failures.items())
    )
    # torch elastic's own record of an exception is a dict holding the message and the traceback
    messages = {r: f.message.get("message") if isinstance(f.message, dict) else f.message for r, f in failures.items()}
    recorded = sorted((f.timestamp, messages[r]) for r, f in failures.items() if f.error_file_data.get("message"))
    return ranks + (f": {recorded[0][1]}" if recorded else "")


def run_local_ranks(
    entrypoint: Callable,
    args: tuple,
    nproc: int,
    start_method: str = "fork",
    extra_env: dict | None = None,
    scratch: Path | None = None,
) -> dict[int, ProcessFailure]:
    """Start `nproc` ranks of `entrypoint(*args)` with torchrun's environment (plus
    `extra_env`), wait, and stop the rest when one fails; the failures by rank ({} if none).
    torch elastic's per-rank error files go to a folder in `scratch` (the run's logs/; None:
    the system's temporary folder), removed once the ranks have ended, and a rank's exception
    is not pickled into /tmp (`exit_on_exception`).

    The elastic agent (`elastic_launch`) is not used here: it forks ranks while
    its own store-server thread serves the ranks already started, and c10d
    formats every socket address with a reverse DNS lookup, so a rank forked
    while that thread held glibc's resolver lock hung forever in its own
    lookup (`python bench/launch_hangs.py`). This process has no threads that
    resolve names when it forks; rank 0 hosts the store, on a free port.
    `spawn` (for CUDA ranks) starts fresh interpreters, which inherit no locks.

    Torch elastic's own report of a failed rank is silenced: it is the traceback
    of its polling loop, not the rank's (the rank prints its own, and
    `failure_summary` gives its reason), and formatting it imports torch._dynamo
    (0.5-0.8 s). Polling every 0.02 s, a replica group's supervisor restarts a
    dead group within ~0.03 s.
    """
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
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
            **(extra_env or {}),
        }
        for rank in range(nproc)
    }
    # torch elastic's per-rank error files, read into the failures as the ranks end, then removed: its
    # default is a torchelastic_* tree in /tmp that every launch leaves behind
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    error_dir = tempfile.mkdtemp(prefix=".elastic-", dir=scratch)
    try:
        ranks = start_processes(
            "harness",
            exit_on_exception,
            {rank: (entrypoint, *args) for rank in range(nproc)},
            envs,
            DefaultLogsSpecs(log_dir=error_dir),
            start_method=start_method,
        )
        try:
            result = ranks.wait(period=0.02)
        finally:
            ranks.close()  # on failure or Ctrl-C: no rank outlives the job
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
    return result.failures


def free_port() -> int:
    """A port free right now (the same small race torch's own launcher accepts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CANNOT_RUN = 2  # a rank's exit status, and its replica group supervisor's, for a setting to fix


def group_cannot_resume(replica_id: int, e: CheckpointError) -> str:
    """The paragraph of a replica group whose checkpoint cannot be read: a setting to fix, as every restart of
    the group would meet it again (while its peers wait for it at their first quorum)."""
    return (
        f"replica group {replica_id} cannot resume from its checkpoint {str(e.path)!r}: {e.problem}. A restart "
        "would read it again. Fix: remove that step_<N> directory: the group then resumes from its previous "
        "checkpoint (or from scratch) and, behind its peers, is healed from a live one at its first quorum, as "
        "fault tolerance heals any group that falls behind; or start the whole run over (checkpoint.resume=never)."
    )


def rank_entrypoint(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> None:
    """A locally started rank's process (in an importable module, for the launcher); it leaves like train.py."""
    setup_logging(run_dir, plan.rank_in_mesh(int(os.environ["RANK"])))
    with exit_now_when_done():
        train_or_exit(cfg, run_dir, plan)


def train_or_exit(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> None:
    """`run_rank`, with the failures a user can act on reported as one message and exit 1."""
    try:
        run_rank(cfg, run_dir, plan)
    except (LighthouseUnreachable, ExchangesFailed) as e:  # a setting to fix, no restart of the group mends
        log.error("%s", e)
        record_failure(str(e))
        sys.exit(CANNOT_RUN)
    except CheckpointError as e:
        if plan.replica_id is not None and e.problem is not None:  # a group's own checkpoint: no restart mends it
            message = group_cannot_resume(plan.replica_id, e)
            log.error("%s", message)
            record_failure(message)
            sys.exit(CANNOT_RUN)
        # with its cause's traceback when it wraps one (a failed save or load), so a bug is not taken for a full disk
        log.error("%s", e, exc_info=e.__cause__ is not None)
        record_failure(str(e))
        sys.exit(1)
    except (NonFiniteLossError, TokenIdsOutOfRange, CommitUnknown) as e:  # one paragraph says it all
        log.error("%s", e)
        record_failure(str(e))
        sys.exit(1)
    except Exception as e:
        if not (isinstance(e, (dist.DistError, RuntimeError)) and "timed out" in str(e).lower()):
            record_failure(": ".join([type(e).__name__, *str(e).splitlines()[:1]]))
            raise  # a bug: its traceback is the report
        message = (
            f"a collective did not finish within dist.timeout_s={cfg.dist.timeout_s} s ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}): another rank stopped responding or died. Fix: find the failing rank "
            f"in {run_dir}/logs/ and the launcher's output; raise dist.timeout_s if steps legitimately take longer."
        )
        log.error("%s", message)
        record_failure(message)
        sys.exit(1)
