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
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.fault_tolerance import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS, REPLICA_GROUP_ID, join_timeout_s, quiet_torchft
from harness.launch.check import start_method
from harness.launch.ranks import failure_summary, rank_entrypoint, run_local_ranks
from harness.plan import RunPlan

log = logging.getLogger("harness")


def start_replica_groups(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> str | None:
    """Run the plan's replica groups against one lighthouse and wait for them all;
    what failed, in one line, or None. The run fails only when a group exhausts its
    restarts (the others go on training meanwhile, and finish).

    Each group's supervisor is a fresh process started with the group's environment,
    so the ranks it forks carry it from their start, visible in /proc/<pid>/environ
    to whatever addresses a group from outside (a variable set after a fork is not)."""
    ft = cfg.fault_tolerance
    OmegaConf.resolve(cfg)
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
        codes = [supervisor.wait() for supervisor in supervisors]
    finally:
        for supervisor in supervisors:  # Ctrl-C or a failed start: no group outlives the job
            if supervisor.poll() is None:
                supervisor.terminate()
                supervisor.wait()
        if lighthouse is not None:
            lighthouse.shutdown()
    if not any(codes):
        return None
    summary = "; ".join(
        f"replica group {replica} "
        + (
            "cannot run (its reason is above)"
            if code == 2
            else f"exhausted fault_tolerance.max_restarts={ft.max_restarts}"
        )
        for replica, code in enumerate(codes)
        if code
    )
    log.error("training failed: %s; see %s/train.log and %s/logs/", summary, run_dir, run_dir)
    return summary


def supervise(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> int:
    """One replica group's supervisor: start its ranks, and again when one dies, up to max_restarts times."""
    replica, restarts, method = plan.replica_id, cfg.fault_tolerance.max_restarts, start_method(cfg)
    # a rank imports torch._dynamo lazily when it first initialises a tensor on the meta device (0.4-0.6 s);
    # imported here, every forked rank of every restart has it already
    import torch._dynamo  # noqa: F401

    for attempt in range(restarts + 1):
        env = {"TORCHELASTIC_RESTART_COUNT": str(attempt)}
        failures = run_local_ranks(rank_entrypoint, (cfg, run_dir, plan), plan.shard, method, env)
        if not failures:
            return 0
        why = failure_summary(failures)
        if all(f.exitcode == 2 for f in failures.values()):  # a setting to fix (the lighthouse): no restart mends it
            print(f"harness: replica group {replica} cannot run: {why}", file=sys.stderr, flush=True)
            return 2
        more = (
            f"restarting it ({attempt + 1} of {restarts}); the other groups train on"
            if attempt < restarts
            else "no restarts left"
        )
        print(f"harness: replica group {replica} failed ({why}); {more}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(supervise(*pickle.loads(sys.stdin.buffer.read())))
