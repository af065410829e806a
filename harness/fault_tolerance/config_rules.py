"""`fault_tolerance=torchft`'s rules and the settings its parts share: whether it is on,
what `validate` refuses, the lighthouse's join timeout, torchft's log level, and under
torchrun which replica group this torchrun is. Light: no torchft until asked, no checkpoints."""

from __future__ import annotations

import logging
import os
import sys
from urllib.parse import urlparse

from omegaconf import DictConfig

from harness.config import ConfigError, FaultToleranceConf
from harness.dist import under_torchrun

NEEDS_TORCHFT = 'Fix: pip install -e ".[ft]" (torchft), or fault_tolerance=none.'
REPLICA_GROUP_ID = "REPLICA_GROUP_ID"  # torchft's launcher convention: this rank's replica group
NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# =1: a heal's sender and receiver log a SHA-256 digest of the whole state, to check that it arrived
# bit for bit (it reads every byte twice on each side, so it is off by default)


MAX_TIMEOUT_S = 7 * 24 * 3600
# torchft's Manager beats to the lighthouse this often (its default, which the harness keeps); a heartbeat
# timeout must outlast a few beats, or the lighthouse drops live groups between two of them
MANAGER_HEARTBEAT_S = 0.1
MIN_HEARTBEATS = 2


def enabled(cfg: DictConfig) -> bool:
    return cfg.get("fault_tolerance") is not None and cfg.fault_tolerance.mode == "torchft"


def config_errors(cfg: DictConfig, replicas: int | None) -> list[str]:
    """Why `cfg` cannot run fault-tolerant on `replicas` replica groups (None: the mesh is unknown)."""
    if not enabled(cfg):
        return []
    ft, errors = cfg.fault_tolerance, []
    quiet_torchft()  # before torchft's first import: its Rust side reads RUST_LOG then
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        errors.append(
            f"fault_tolerance=torchft needs the torchft package, which does not import ({e}). {NEEDS_TORCHFT}"
        )
    if replicas is not None and replicas < 2:
        errors.append(
            f"fault_tolerance=torchft with {replicas} replica (sharding={cfg.sharding.strategy}): a replica group "
            "survives only by its peers, so there must be at least 2. Fix: sharding=no_shard with 2 or more ranks, "
            "or sharding=hybrid_shard sharding.replicate=2 (or more), or fault_tolerance=none."
        )
    if ft.min_replicas < 1 or (replicas is not None and ft.min_replicas > replicas):
        errors.append(
            f"fault_tolerance.min_replicas={ft.min_replicas} must be between 1 and the {replicas} replica groups: "
            "with more, no quorum ever forms and training waits forever. Fix: fault_tolerance.min_replicas=1 "
            "(survivors train on alone) up to the replica count."
        )
    if ft.lighthouse is not None:
        url = urlparse(str(ft.lighthouse))
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            errors.append(
                f"fault_tolerance.lighthouse={ft.lighthouse!r} is not a lighthouse URL (http://host:port). Fix: the "
                "address torchft_lighthouse prints, e.g. fault_tolerance.lighthouse=http://node0:29510, or null to "
                "have the launcher start one."
            )
    if cfg.sharding.strategy == "ddp":
        errors.append(
            "sharding=ddp with fault_tolerance=torchft: DDP's communication hook crosses replicas outside the "
            "replica link. Fix: sharding=no_shard (one replica per rank) or hybrid_shard."
        )
    target = cfg.averager.get("_target_")
    if (target is None or cfg.averager.get("warmup_steps")) and cfg.optimizer.get("in_backward"):
        errors.append(
            "optimizer.in_backward=true with fault_tolerance=torchft and synchronous steps (averager=none, or "
            "an averager's warmup_steps): such a step is taken only once its gradient exchange across replica "
            "groups committed, but in backward each parameter steps before that is known. Fix: "
            "optimizer.in_backward=false, or an averager with averager.warmup_steps=0."
        )
    if target is not None and "Hierarchical" in str(target):
        errors.append(
            "averager=hierarchical with fault_tolerance=torchft: it averages within fixed subsets of replicas, "
            "which a quorum that changes at run time cannot keep. Fix: averager=periodic or averager=diloco."
        )
    for key in ("quorum_timeout_s", "timeout_s", "join_timeout_s"):
        if ft[key] is not None and not 0 < ft[key] <= MAX_TIMEOUT_S:
            default = getattr(FaultToleranceConf, key)
            fix = (
                f"fault_tolerance.{key}={default:g} (the default)"
                if default is not None
                else f"fault_tolerance.{key}=null (the default: 0.2 s with 2 replica groups, else 10 s)"
            )
            errors.append(
                f"fault_tolerance.{key}={ft[key]} must be a positive number of seconds, at most {MAX_TIMEOUT_S} (a "
                f"week: torchft keeps its timeouts as milliseconds and durations). Fix: {fix}."
            )
    errors += _heartbeat_errors(ft.heartbeat_timeout_s)
    if ft.max_restarts < 0:
        errors.append(f"fault_tolerance.max_restarts={ft.max_restarts} must be >= 0. Fix: 0 for no restarts.")
    if ft.max_failed_exchanges < 1:
        errors.append(
            f"fault_tolerance.max_failed_exchanges={ft.max_failed_exchanges} must be >= 1: a run whose exchanges "
            "across replica groups never commit trains nothing. Fix: fault_tolerance.max_failed_exchanges=5."
        )
    if ft.replica_id is not None and not under_torchrun():
        errors.append(
            f"fault_tolerance.replica_id={ft.replica_id}: `python train.py` starts every replica group itself and "
            "numbers them; the key is for one torchrun per group (docs/failures.md). Fix: drop "
            "fault_tolerance.replica_id, or start each group with torchrun and its own replica id."
        )
    return errors


def _heartbeat_errors(heartbeat: float) -> list[str]:
    """The lighthouse counts a group as gone once it has not beaten for `heartbeat` seconds: a few of the
    Managers' beats at least, and a number torchft's lighthouse can hold."""
    least, default = MIN_HEARTBEATS * MANAGER_HEARTBEAT_S, FaultToleranceConf.heartbeat_timeout_s
    fix = f"Fix: fault_tolerance.heartbeat_timeout_s={default:g} (the default), at least {least:g}."
    if 0 < heartbeat < least:
        return [
            f"fault_tolerance.heartbeat_timeout_s={heartbeat} is shorter than {MIN_HEARTBEATS} of the heartbeats "
            f"torchft's Manager sends the lighthouse (one every {MANAGER_HEARTBEAT_S} s): the lighthouse would "
            "count live groups as gone between two beats, every quorum would hold one group, and the groups would "
            f"train apart. {fix}"
        ]
    if least <= heartbeat <= MAX_TIMEOUT_S:
        return []
    return [
        f"fault_tolerance.heartbeat_timeout_s={heartbeat} must be a number of seconds of at least {least:g} "
        f"({MIN_HEARTBEATS} of the heartbeats torchft's Manager sends the lighthouse, one every "
        f"{MANAGER_HEARTBEAT_S} s) and at most {MAX_TIMEOUT_S} (a week: torchft keeps it as milliseconds): the "
        f"lighthouse counts a group that has not beaten for this long as gone. {fix}"
    ]


def join_timeout_s(ft: DictConfig, groups: int) -> float:
    """How long the lighthouse waits for late groups once a quorum is possible (`fault_tolerance.join_timeout_s`).
    A quorum needs more than half of the groups that beat: with 2 groups a live one is never left out for
    being late, so a short wait only spares the survivor the dead group's heartbeat timeout after a failure
    (bench/faults.py); with 3 or more a short wait leaves late live groups out (docs/failures.md)."""
    if ft.join_timeout_s is not None:
        return ft.join_timeout_s
    return 0.2 if groups == 2 else 10.0


TORCHFT_MODULE_LOGGERS = (  # each module's logger (a parent's filter does not see a child's records)
    "torchft.manager",
    "torchft.process_group",
    "torchft.coordination",
    "torchft.checkpointing.http_transport",  # the heal's server: a request whose asker hung up, with its traceback
    "torchft.checkpointing.pg_transport",
)


def quiet_torchft() -> None:
    """torchft logs every quorum and commit at INFO and warns at every reconfiguration on CPU (no NCCL
    flight recorder): errors only (its Rust side through RUST_LOG), so a group's joins, leaves, heals
    and failed exchanges are the harness's own log lines; and each error as its first line, without
    the traceback and C++ frames a failed collective carries (the harness says what it did about it).
    c10d's C++ log lines too (a peer's closed connection, a connect that timed out, each with some 30
    lines of C++ frames), but fatal ones: each such failure also reaches the harness as an exception,
    which it reports in one line. Read when torch loads, so in the processes started after this call
    (the replica groups' supervisors and their ranks)."""
    os.environ.setdefault("RUST_LOG", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    # a logger's filters see only its own records, not its children's: each module's logger by name
    for name in ("torchft", *TORCHFT_MODULE_LOGGERS, "torchft_commits", "torchft_quorums", "torchft_errors"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        if not any(isinstance(f, _FirstLine) for f in logger.filters):
            logger.addFilter(_FirstLine())
    try:
        from torchft.http import _IPv6HTTPServer
    except ImportError:  # no torchft: validate says so, with the fix
        return

    # the heal's checkpoint server is a socketserver, which prints the traceback of a request that failed
    # (its asker gave up and hung up: BrokenPipeError) to stderr from its thread; torchft has logged the cause
    _IPv6HTTPServer.handle_error = _log_failed_request


def _log_failed_request(server: object, request: object, client_address: tuple) -> None:
    logging.getLogger("torchft.checkpointing").error(
        "a heal request from %s failed: %r", client_address[0], sys.exc_info()[1]
    )


class _FirstLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = record.getMessage().split("\n", 1)[0], None
        record.exc_info = record.exc_text = None
        return True


def torchrun_groups(cfg: DictConfig) -> tuple[int, int]:
    """Under torchrun, one torchrun is one replica group: (its replica id, the number of groups),
    from `fault_tolerance.replica_id` or REPLICA_GROUP_ID, and NUM_REPLICA_GROUPS."""
    replica_id = cfg.fault_tolerance.replica_id
    if replica_id is None and REPLICA_GROUP_ID in os.environ:
        replica_id = int(os.environ[REPLICA_GROUP_ID])
    groups = int(os.environ.get(NUM_REPLICA_GROUPS, 0))
    problems = []
    if replica_id is None:
        problems.append(f"no replica id (fault_tolerance.replica_id, or {REPLICA_GROUP_ID} in the environment)")
    if groups < 2:
        problems.append(f"{NUM_REPLICA_GROUPS}={os.environ.get(NUM_REPLICA_GROUPS)} (must be the replica groups, >= 2)")
    elif replica_id is not None and not 0 <= replica_id < groups:
        problems.append(f"replica id {replica_id} outside 0..{groups - 1}")
    if problems:
        raise ConfigError(
            "fault_tolerance=torchft under torchrun: each torchrun is one replica group, but "
            + "; ".join(problems)
            + f". Fix: start every group's torchrun with {REPLICA_GROUP_ID}=<0..R-1> {NUM_REPLICA_GROUPS}=<R> and "
            f"{LIGHTHOUSE_ENV}=<lighthouse URL> in its environment (docs/failures.md)."
        )
    return replica_id, groups


def check_group_world(plan, group_world_size: int) -> None:
    """A torchrun's ranks must be exactly one replica of the mesh."""
    if plan.shard != group_world_size:
        raise ConfigError(
            f"fault_tolerance=torchft under torchrun: this torchrun has {group_world_size} ranks, but the mesh "
            f"({plan.replicate} replicas x {plan.shard} ranks over {plan.world_size}) has replicas of {plan.shard}; "
            "each torchrun must be one replica group. Fix: sharding=no_shard for one rank per group, or "
            "sharding=hybrid_shard with sharding.replicate=null (one replica per torchrun)."
        )
