"""`python train.py fault_tolerance=torchft` on one machine: a torchft lighthouse
(unless `fault_tolerance.lighthouse` names one) and one supervisor per replica
group, each starting its group's ranks and restarting only that group when one
of its ranks dies, up to `fault_tolerance.max_restarts` times. Every rank of
group r has torchft's launcher environment: REPLICA_GROUP_ID=r,
NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE, so fault injectors and schedulers
can address a group.

Across machines each group is its own `torchrun` (docs/failures.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException

from harness.fault_tolerance import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS, REPLICA_GROUP_ID, join_timeout_s, quiet_torchft
from harness.fault_tolerance.outputs import finished_step
from harness.launch.check import start_method
from harness.launch.exit import exit_now, on_stop_signals
from harness.launch.ranks import CANNOT_RUN, failure_summary, rank_entrypoint, run_local_ranks
from harness.plan import RunPlan
from harness.sweep import FINISHED_WITHOUT_GROUPS

log = logging.getLogger("harness")


def start_replica_groups(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> tuple[int, str | None]:
    """Run the plan's replica groups against one lighthouse and wait for them all;
    the exit status and what went wrong in one line (None when nothing did). A group
    lost for good (it exhausted its restarts or its supervisor died) fails the run, unless
    a group trained every step: then the run's model is complete and the status is
    FINISHED_WITHOUT_GROUPS (docs/failures.md). A group that cannot run (a setting to fix)
    fails the run whatever the others did: a group left alone commits every exchange, so
    its finishing says nothing of the setting.

    Each group's supervisor is a fresh process started with the group's environment,
    so the ranks it forks carry it from their start, visible in /proc/<pid>/environ
    to whatever addresses a group from outside (a variable set after a fork is not)."""
    ft = cfg.fault_tolerance
    OmegaConf.resolve(cfg)
    if cfg.dist.threads_per_rank is None:  # every group's ranks share this machine's cores (each group alone
        # would take them all: 4 groups of 1 rank ran 8 threads on 2 cores, 5-10x slower a step)
        cfg.dist.threads_per_rank = max(1, len(os.sched_getaffinity(0)) // (plan.replicate * plan.shard))
    quiet_torchft()  # the lighthouse's log, and inherited by the groups
    lighthouse = None
    if ft.lighthouse is None:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=ft.min_replicas,
            join_timeout_ms=int(join_timeout_s(ft, plan.replicate) * 1000),
            heartbeat_timeout_ms=int(ft.heartbeat_timeout_s * 1000),
        )
    address = ft.lighthouse or lighthouse.address()
    log.info(
        "starting %d replica groups of %d rank(s) (lighthouse %s; run dir %s)",
        plan.replicate,
        plan.shard,
        address,
        run_dir,
    )
    supervisors = []
    try:
        for replica in range(plan.replicate):
            env = {
                **os.environ,
                REPLICA_GROUP_ID: str(replica),
                NUM_REPLICA_GROUPS: str(plan.replicate),
                LIGHTHOUSE_ENV: address,
            }
            supervisor = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, env=env)
            supervisor.stdin.write(pickle.dumps((cfg, run_dir, dataclasses.replace(plan, replica_id=replica))))
            supervisor.stdin.close()
            supervisors.append(supervisor)
        codes, stopped = wait_for_groups(supervisors)
    finally:
        for supervisor in supervisors:  # Ctrl-C or a failed start: no group outlives the job
            if supervisor.poll() is None:
                supervisor.terminate()
                supervisor.wait()
        if lighthouse is not None:
            lighthouse.shutdown()
    if not any(codes):
        return 0, None
    lost = [r for r, code in enumerate(codes) if code]
    why = {r: "was stopped: the run cannot succeed" if r in stopped else lost_because(codes[r], ft) for r in lost}
    summary = "; ".join(f"replica group {r} {why[r]}" for r in lost)
    finished = [r for r in range(plan.replicate) if (finished_step(run_dir, r) or 0) >= cfg.train.steps]
    if finished and CANNOT_RUN not in codes:
        log.warning(
            "training finished without replica group(s) %s: %s. The run's model is complete: replica group(s) %s "
            "trained all %d steps (their checkpoints and metrics are in %s/replica_group_<r>/); exit status %d",
            ", ".join(map(str, lost)),
            summary,
            ", ".join(map(str, finished)),
            cfg.train.steps,
            run_dir,
            FINISHED_WITHOUT_GROUPS,
        )
        return FINISHED_WITHOUT_GROUPS, summary
    log.error("training failed: %s; see %s/train.log and %s/logs/", summary, run_dir, run_dir)
    return 1, summary


def wait_for_groups(supervisors: list[subprocess.Popen]) -> tuple[list[int], set[int]]:
    """Wait for every group's supervisor: their exit statuses, and the groups stopped here. Once a group
    cannot run (a setting to fix), the run fails whatever the others do, so they are stopped at once
    rather than left to train for nothing (or, restarted, to wait `quorum_timeout_s` for that group)."""
    while None in (codes := [supervisor.poll() for supervisor in supervisors]):
        if CANNOT_RUN in codes:
            stopped = {r for r, code in enumerate(codes) if code is None}
            for r in stopped:
                supervisors[r].terminate()
            return [supervisor.wait() for supervisor in supervisors], stopped
        time.sleep(0.1)
    return codes, set()


def lost_because(code: int, ft: DictConfig) -> str:
    """Why a replica group's supervisor ended with exit status `code` (negative: the signal that killed it)."""
    if code < 0:
        return (
            f"was lost: its supervisor died of {signal.Signals(-code).name}, so it could not be restarted (the "
            "supervisor is what restarts a group)"
        )
    if code == CANNOT_RUN:
        return "cannot run (its reason is above)"
    return f"exhausted fault_tolerance.max_restarts={ft.max_restarts}"


def supervise(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> int:
    """One replica group's supervisor: start its ranks, and again when one dies, up to max_restarts times."""
    replica, restarts, method = plan.replica_id, cfg.fault_tolerance.max_restarts, start_method(cfg)
    # a rank imports torch._dynamo lazily when it first initialises a tensor on the meta device (0.4-0.6 s);
    # imported here, every forked rank of every restart has it already
    import torch._dynamo  # noqa: F401

    for attempt in range(restarts + 1):
        env = {"TORCHELASTIC_RESTART_COUNT": str(attempt)}
        failures = run_local_ranks(rank_entrypoint, (cfg, run_dir, plan), plan.shard, method, env, run_dir / "logs")
        if not failures:
            return 0
        why = failure_summary(failures)
        if all(f.exitcode == CANNOT_RUN for f in failures.values()):  # a setting to fix: no restart mends it
            print(f"harness: replica group {replica} cannot run: {why}", file=sys.stderr, flush=True)
            return CANNOT_RUN
        more = (
            f"restarting it ({attempt + 1} of {restarts}); the other groups train on"
            if attempt < restarts
            else "no restarts left"
        )
        print(f"harness: replica group {replica} failed ({why}); {more}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    try:
        code = supervise(*pickle.loads(sys.stdin.buffer.read()))
    except SignalException as e:  # stopped by the launcher (or Ctrl-C): its ranks are stopped too, quietly
        code = 128 + e.sigval
    # its exit status is settled: a stop signal changes nothing now, and it leaves without finalizing the
    # interpreter, whose finalizers (torch.library's, at exit) took a stop signal as a traceback
    on_stop_signals(signal.SIG_IGN)
    exit_now(code)
