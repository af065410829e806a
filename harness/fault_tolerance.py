"""Replica groups that survive each other, on torchft (`fault_tolerance=torchft`).

Each replica of the mesh is a replica group: a world of its own whose mesh is
(1 x shard); the `replicate` dimension is torchft's `Manager`
(docs/design.md#replica-groups-the-mesh-under-fault-tolerance). Here:
`config_errors` (the rules `validate` runs), `TorchftLink` (the replica link
over the Manager: a quorum, its process group, `should_commit`) and
`ReplicaGroup`, the trainer's side: it opens a quorum at the start of every
step that crosses replicas, and gives and takes the heal state (the
checkpoint parts, from memory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp
from torch.distributed.tensor import DTensor

from harness import metrics
from harness.config import ConfigError
from harness.dist import local_view
from harness.rng import seed_rank

log = logging.getLogger(__name__)

NEEDS_TORCHFT = 'Fix: pip install -e ".[ft]" (torchft), or fault_tolerance=none.'
REPLICA_GROUP_ID = "REPLICA_GROUP_ID"  # torchft's launcher convention: this rank's replica group
NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# =1: a heal's sender and receiver log a SHA-256 digest of the whole state, to check that it arrived
# bit for bit (it reads every byte twice on each side, so it is off by default)
HEAL_DIGEST_ENV = "HARNESS_HEAL_DIGEST"
# in a replica group's outputs once it has trained every step: a peer restarted after that finds no one
# to heal from (the lighthouse cannot tell finished groups from dead ones), so it stops instead of
# waiting quorum_timeout_s and training on alone
FINISHED = "finished.json"


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
    if target is None:
        errors.append(
            "averager=none with fault_tolerance=torchft: synchronous training crosses replicas at every step, so "
            "one lost group stalls every step; replica groups pay off with local SGD. "
            "Fix: averager=periodic or averager=diloco."
        )
    elif "Hierarchical" in str(target):
        errors.append(
            "averager=hierarchical with fault_tolerance=torchft: it averages within fixed subsets of replicas, "
            "which a quorum that changes at run time cannot keep. Fix: averager=periodic or averager=diloco."
        )
    for key in ("quorum_timeout_s", "timeout_s", "heartbeat_timeout_s", "join_timeout_s"):
        if ft[key] is not None and not ft[key] > 0:
            errors.append(f"fault_tolerance.{key}={ft[key]} must be positive. Fix: a number of seconds, e.g. 60.")
    if ft.max_restarts < 0:
        errors.append(f"fault_tolerance.max_restarts={ft.max_restarts} must be >= 0. Fix: 0 for no restarts.")
    return errors


def join_timeout_s(ft: DictConfig, groups: int) -> float:
    """How long the lighthouse waits for late groups once a quorum is possible (`fault_tolerance.join_timeout_s`).
    A quorum needs more than half of the groups that beat: with 2 groups a live one is never left out for
    being late, so a short wait only spares the survivor the dead group's heartbeat timeout after a failure
    (bench/faults.py); with 3 or more a short wait leaves late live groups out (docs/failures.md)."""
    if ft.join_timeout_s is not None:
        return ft.join_timeout_s
    return 0.2 if groups == 2 else 10.0


def quiet_torchft() -> None:
    """torchft logs every quorum and commit at INFO and warns at every reconfiguration on CPU (no NCCL
    flight recorder): errors only (its Rust side through RUST_LOG), so a group's joins, leaves, heals
    and failed exchanges are the harness's own log lines."""
    os.environ.setdefault("RUST_LOG", "error")
    for name in ("torchft", "torchft_commits", "torchft_quorums", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)


def group_outputs(cfg: DictConfig, run_dir: Path, replica_id: int) -> tuple[Path, Path | None]:
    """A replica group's own outputs: `<run dir>/replica_group_<r>/` holds its metrics.jsonl,
    W&B and TensorBoard runs and checkpoints (a dead group must not stop the others' logging
    or saving); returns that directory and the checkpoint the group resumes from, and points
    `cfg.checkpoint` at the group's checkpoints."""
    from harness.checkpoint_paths import group_checkpoint_config, group_dir, resume_path

    cfg.checkpoint = group_checkpoint_config(cfg.checkpoint, replica_id)
    outputs = group_dir(run_dir, replica_id)
    outputs.mkdir(exist_ok=True)
    (outputs / FINISHED).unlink(missing_ok=True)  # an earlier run's, in this run dir: this one is not finished
    return outputs, resume_path(cfg.checkpoint, outputs)


class PeersFinished(Exception):
    """A restarted replica group found that a peer has trained every step: there is no one left to heal
    from, and the run's model is its peers'; the group stops (and its rank exits 0)."""


def finished_peer(run_dir: Path, replica_id: int, steps: int) -> tuple[int, int] | None:
    """(a peer group of `replica_id` under `run_dir` that has trained `steps` steps, its step), or None."""
    from harness.checkpoint_paths import GROUP_DIR

    for marker in sorted(run_dir.glob(f"replica_group_*/{FINISHED}")):
        group = GROUP_DIR.match(marker.parent.name)
        try:
            step = json.loads(marker.read_text())["step"]
        except (OSError, ValueError, KeyError):  # being written, or gone: not finished yet
            continue
        if group and int(group.group(1)) != replica_id and step >= steps:
            return int(group.group(1)), step
    return None


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


class _Reported:
    """A collective of the Manager's process group whose failure (a lost peer, a
    timeout) is reported to the Manager instead of raised: the exchange then
    does not commit, and the group trains on.

    The first failure also lets go of this group's end of the process group at
    once, not at the next quorum: a gloo ring member whose neighbour died fails
    at once, but the live groups further along the ring wait on it, and they
    hear of the failure only when its connections close. Gloo's abort() does
    not close them; the context's destruction, when no work holds it any more,
    does (4 gloo ranks, one SIGKILLed mid-allreduce: the rank two places behind
    failed after the full timeout without this, after 0.08 s with it)."""

    def __init__(self, link: TorchftLink, start):
        self.link, self.work = link, None
        if link.manager.errored() is None:
            try:
                self.work = start()
            except Exception as e:  # the group is broken: report, let the commit say no
                self._report(e)

    def wait(self) -> None:
        if self.work is not None:
            try:
                self.work.wait()
            except Exception as e:
                self._report(e)
            self.work = None

    def _report(self, e: Exception) -> None:
        self.work = None
        if self.link.manager.errored() is not None:  # reported and released already
            return
        log.warning("a cross-replica collective failed (%s: %s): this exchange will not commit", type(e).__name__, e)
        self.link.manager.report_error(e)
        self.link.pg.shutdown()  # torchft's wrappers drop the process group; the next quorum configures a new one


class LighthouseUnreachable(RuntimeError):
    """The lighthouse did not answer; the message names it and the fix (no restart helps)."""


def forget_previous_manager(group_rank: int) -> None:
    """The Manager publishes its address in the group's rendezvous store; torchrun keeps that store
    across its restarts, so a restarted group would find the dead attempt's address there. The
    group's first rank deletes it before any rank creates its Manager."""
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if group_rank == 0:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


PLACE_STRIDE = 2**32  # a Manager step is commits * this + steps: more commits always rank first


class TorchftLink:
    """The replica link over torchft's Manager: the replicas are the replica groups in
    the current quorum; `begin()` is a (synchronous) quorum, which heals this group
    when it is behind; `commit()` is `should_commit`."""

    needs_commit = True

    def __init__(self, ft: DictConfig, replica_id: int, group_rank: int, group_world_size: int, device: torch.device):
        self.commits = 0  # exchanges this group committed (the heal state and checkpoints carry it)
        quiet_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

        forget_previous_manager(group_rank)
        timeout = timedelta(seconds=ft.timeout_s)
        self.pg = ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        lighthouse = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        try:
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,  # a heal completes inside the quorum, before the step runs
                timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=timeout,
                rank=group_rank,
                world_size=group_world_size,
                lighthouse_addr=lighthouse,
                replica_id=str(replica_id),
                init_sync=False,  # every group starts from the same seeded weights
            )
        except RuntimeError as e:
            if "failed to connect" not in str(e):
                raise
            raise LighthouseUnreachable(
                f"fault_tolerance: the torchft lighthouse at {lighthouse} (fault_tolerance.lighthouse, or "
                f"{LIGHTHOUSE_ENV}) did not answer within fault_tolerance.timeout_s={ft.timeout_s} s "
                f"({str(e).split(';')[0]}). Fix: start it (torchft_lighthouse --min_replicas 1) and pass the "
                "address it prints, or leave fault_tolerance.lighthouse=null to have the launcher start one."
            ) from None

    def size(self) -> int:
        return self.manager.num_participants()

    def all_reduce(self, tensor: torch.Tensor) -> _Reported:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return _Reported(self, lambda: self.pg.allreduce([tensor], opts))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> _Reported:
        return _Reported(self, lambda: self.pg.alltoall_base(output, input, [], [], AllToAllOptions()))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> _Reported:
        return _Reported(self, lambda: self.pg.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()))

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        self.all_reduce(tensor).wait()

    def begin(self, steps_done: int = 0) -> None:
        """A quorum at the start of the step after `steps_done` steps. torchft heals the groups
        whose Manager step is below the quorum's highest, so that step is set here to this group's
        place: its committed exchanges, then its steps. A group that missed a commit, and a
        restarted group (from scratch or from its own older checkpoint), are behind every live
        peer and so are healed; groups at the same place are not."""
        place = self.commits * PLACE_STRIDE + steps_done
        self.manager.load_state_dict({"step": place, "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum()

    def reform(self) -> None:
        """A quorum of the last one's members still alive, without heals (torchft's shrink_only), to redo
        an exchange that did not commit inside its step: a group outside it would need a heal, and a
        heal mid-step would send state that is half this step's."""
        self.manager.start_quorum(allow_heal=False, shrink_only=True)

    def commit(self) -> bool:
        committed = self.manager.should_commit()
        self.commits += committed
        return committed

    def failed(self) -> bool:
        return self.manager.errored() is not None

    def state_dict(self) -> dict:
        return {"commits": self.commits}

    def load_state_dict(self, state: dict) -> None:
        self.commits = state["commits"]

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class ReplicaGroup:
    """One replica group's side of fault tolerance, for the Trainer: the quorum at
    the start of each step that crosses replicas (and of the first step a group
    runs, which is how a restarted group joins), the heal state, the ft/* metrics."""

    def __init__(
        self, trainer, link: TorchftLink, replica_id: int, shard: int, seed: int, alone_after_s: float, outputs: Path
    ):
        self.trainer, self.link, self.replica_id = trainer, link, replica_id
        self.shard, self.seed, self.alone_after_s, self.outputs = shard, seed, alone_after_s, outputs
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0  # the launcher's and torchrun's
        self.heals, self.replicas, self.joined = 0, None, False
        self.row: dict = {}
        link.manager.register_state_dict_fn("harness", self._load_heal_state, self._heal_state)

    def before_step(self) -> None:
        """Open a quorum if the coming step crosses replicas (or is this group's first):
        a heal here replaces every part of the job, the trainer's step included."""
        averager = self.trainer.job.cross_replica.averager
        if self.joined and not averager.crosses_replicas():
            return
        heals = self.heals
        self._quorum(lambda: self.link.begin(self.trainer.state.step) if self.joined else self._join())
        self.joined = True
        if self.heals > heals:
            self.row[metrics.FT_HEAL_TIME] = self.row[metrics.FT_QUORUM_TIME]

    def complete_the_last_exchange(self) -> None:
        """At the run's last step, redo its exchange if it did not commit (a group was lost in it): no
        later sync would take its window in, so each survivor would end with a model of its own. The
        survivors redo it among themselves (`TorchftLink.reform`); a group restarted meanwhile finds
        them finished and stops. Each retry follows a loss, so there are at most as many as groups."""
        averager, step = self.trainer.job.cross_replica.averager, self.trainer.state.step + 1
        for _ in range(self.replicas):
            if averager.uncommitted is None:
                return
            self._quorum(self.link.reform)
            log.warning(
                "step %d: the last exchange did not commit; redoing it among the %d replica groups left",
                step,
                self.replicas,
            )
            averager.redo_uncommitted()
        if averager.uncommitted is not None:
            log.warning("step %d: the last exchange did not commit again: each group ends with its own model", step)

    def _quorum(self, open_quorum) -> None:
        """Open a quorum with `open_quorum`; log a change in its size; its time adds to this step's ft/quorum_s."""
        start = time.perf_counter()
        open_quorum()
        replicas = self.link.size()
        if self.replicas is not None and replicas != self.replicas:
            change = "joined" if replicas > self.replicas else "left"
            log.warning("replica group(s) %s: %d in the quorum (was %d)", change, replicas, self.replicas)
        self.replicas = replicas
        self.row[metrics.FT_QUORUM_TIME] = self.row.get(metrics.FT_QUORUM_TIME, 0.0) + time.perf_counter() - start

    def _join(self) -> None:
        """A group's first quorum, at its (re)start: repeated until it holds another group (then a
        group that is behind has been healed), or `fault_tolerance.quorum_timeout_s` has passed with none. The
        lighthouse gives a lone asker a quorum of its own once the others' wait is over, or at
        once while no other group's Manager is up; a group that took that would train on alone,
        out of step with its peers, and hold up their quorums. Groups started together meet here,
        and a restarted group waits here for its peers' next quorum, unless they have finished."""
        deadline = time.monotonic() + self.alone_after_s
        while True:
            if self.restarted:
                self._stop_if_a_peer_finished()
            heals = self.heals
            self.link.begin(self.trainer.state.step)
            if self.link.size() > 1 or self.heals > heals or time.monotonic() > deadline:
                return
            time.sleep(0.2)

    def _stop_if_a_peer_finished(self) -> None:
        """Raise PeersFinished if a peer has trained every step (read by the group's first rank, on a file
        system its peers write to: one machine, or a shared run dir; elsewhere the group waits as before)."""
        found = [finished_peer(self.outputs.parent, self.replica_id, self.trainer.cfg.steps)]
        dist.broadcast_object_list(found, src=0)  # every rank of the group stops, or none
        if found[0] is not None:
            peer, step = found[0]
            raise PeersFinished(
                f"replica group {self.replica_id} restarted after replica group {peer} finished training (step "
                f"{step}): no peer is left to heal from, and the run's model is theirs, so it stops at step "
                f"{self.trainer.state.step} (its newest checkpoint)"
            )

    def finish(self) -> None:
        """This group has trained every step: say so in its outputs, for a peer that restarts after it exits."""
        if dist.get_rank() == 0:
            (self.outputs / FINISHED).write_text(json.dumps({"step": self.trainer.state.step}))

    def gradients_committed(self) -> bool:
        """A warmup step's gradient exchange succeeded with enough replica groups (else the step is skipped)."""
        return not self.trainer.job.cross_replica.averager.synchronous or self.link.commit()

    def step_metrics(self) -> dict:
        """This step's ft/* figures (the quorum's, if one opened), then reset."""
        row, self.row = {**self.row, metrics.FT_REPLICAS: self.replicas or 0, metrics.FT_HEALS: self.heals}, {}
        return row

    def _heal_state(self) -> dict:
        """What a live peer sends a group it heals: the job's state at the start of this step, as
        local tensors (ranks with the same shard index hold the same slices), copied, because
        the transfer reads them while this group trains on."""
        state = self._state()
        if os.environ.get(HEAL_DIGEST_ENV) == "1":
            log.info("sending the heal state of step %d (digest %s)", state["step"], digest(state))
        return state

    def _state(self) -> dict:
        from harness.checkpoint.checkpointer import tensor_state
        from harness.checkpoint.replicas import inner_optimizer

        job = self.trainer.job
        parts = job.checkpoint_parts()
        return _detached(
            {
                "step": self.trainer.state.step,
                "model": {fqn: local_view(p) for fqn, p in job.model.named_parameters()},
                "optim": get_optimizer_state_dict(job.model, inner_optimizer(job.optimizer)),
                "parts": {name: part.state_dict() for name, part in parts.items()},
                "part_tensors": {name: tensor_state(part) for name, part in parts.items()},
            }
        )

    @torch.no_grad()
    def _load_heal_state(self, state: dict) -> None:
        """Take a peer's heal state: every value is the peer's, bit for bit; the data
        position is global, so this group reads its own samples from it, and its RNG
        is seeded from the step and its ranks."""
        from harness.checkpoint.checkpointer import tensor_state
        from harness.checkpoint.replicas import inner_optimizer

        job, step = self.trainer.job, state["step"]
        for fqn, p in job.model.named_parameters():
            local_view(p).copy_(state["model"][fqn])
        params = dict(job.model.named_parameters())
        optim = _in_layout(state["optim"], params)
        set_optimizer_state_dict(job.model, inner_optimizer(job.optimizer), optim)
        parts = job.checkpoint_parts()
        for name, part in parts.items():
            part.load_state_dict({"step": step, **state["parts"][name]})
        for name, part in parts.items():
            tensors = tensor_state(part)
            if tensors:
                _copy_into(tensors, state["part_tensors"][name])
                part.load_tensor_state_dict(tensors)
        self.trainer.state.step = step
        rank = self.replica_id * self.shard + dist.get_rank()
        seed_rank(self.seed + step, rank)
        self.heals += 1
        if os.environ.get(HEAL_DIGEST_ENV) == "1":  # the state as this group now holds it, against the sender's
            log.info("healed from a live peer at step %d (digest %s)", step, digest(self._state()))
        else:
            log.info("healed from a live peer at step %d", step)


def digest(state) -> str:
    """A short hash of a state tree's values, bit for bit (tensors by their bytes, in tree order)."""
    h = hashlib.sha256()

    def walk(value) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif torch.is_tensor(value):
            h.update(str(value.dtype).encode())
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())

    walk(state)
    return h.hexdigest()[:16]


def _detached(state):
    if isinstance(state, dict):
        return {k: _detached(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_detached(v) for v in state)
    if torch.is_tensor(state):
        return local_view(state).detach().clone()
    return state


def _in_layout(optim: dict, params: dict) -> dict:
    """A sent optimizer state dict (local tensors) with each parameter-shaped state
    laid out as its parameter (DTensors under FSDP2), for `set_optimizer_state_dict`."""
    state = {}
    for fqn, values in optim["state"].items():
        p = params[fqn]
        state[fqn] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == local_view(p).shape and v.dim() > 0
            else v
            for k, v in values.items()
        }
    return {"state": state, "param_groups": optim["param_groups"]}


def _copy_into(target: dict, sent: dict) -> None:
    for key, value in target.items():
        if isinstance(value, dict):
            _copy_into(value, sent[key])
        elif torch.is_tensor(value):
            local_view(value).copy_(sent[key])
