"""Post-local SGD's averagers (arXiv 1808.07217): after the local optimizer
step, the *parameters* are averaged across replicas where the run's clock
says; inside a replica the ranks hold different shards, so nothing is
averaged along `shard`.

Both are driven by PyTorch's `PostLocalSGDOptimizer`. Each says when it
exchanges as a `Schedule` of its config's keys (`schedule`), which the run's
`Clock` plans from; at each step it reads the clock's tick and does what the
tick says (an exchange of all replicas, a hierarchy's group meeting).
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.device_mesh import DeviceMesh

from harness import metrics
from harness.averaging import config_rules
from harness.averaging.collectives import average_local_shards, replica_subgroups
from harness.averaging.link import MeshLink, ReplicaLink
from harness.averaging.traffic import CrossReplicaTraffic
from harness.clock import Clock, Schedule

# the averager keys its class reads into its `Schedule` for the clock, not into its constructor
SCHEDULE_KEYS = (
    "warmup_steps",
    "period",
    "sync_delay",
    "balance",
    "period_schedule",
    "min_period",
    "max_period",
    "comm_budget",
)


def pace_keys(cfg: DictConfig) -> dict:
    """The keys every averager's schedule takes from `averager.balance`, `period_schedule`, `min_period`, and
    `period=auto`'s `comm_budget`."""
    return {
        "balance": str(cfg.get("balance", "steps")),
        "period_schedule": config_rules.AUTO if config_rules.is_auto(cfg) else str(cfg.get("period_schedule", "fixed")),
        "min_period": cfg.get("min_period", 1),
        "comm_budget": cfg.get("comm_budget", 0.1),
    }


class ReplicaAverager(ModelAverager):
    """`PeriodicModelAverager`'s schedule over the replicate group, on local shards.

    The stock averager cannot average FSDP2 parameters (verified on torch 2.13):
    on DTensors, `c10d.allreduce_` has no sharding strategy / uneven shards
    cannot be flattened; on `to_local()` tensors it filters everything out
    because their `.grad` is None; and `utils.average_parameters` on them is a
    silent no-op (it rebinds `.data` of temporaries). This one all-reduces a
    flat copy of the local shards in buckets and `copy_`s the mean back in
    place: 1/shard of the model per rank, no all-gather. It works on plain
    tensors (DDP) too, so both paths report the same drift and bytes.
    """

    config_errors = staticmethod(config_rules.periodic_errors)

    def __init__(
        self,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        clock: Clock,
        comm_dtype: str = "float32",
        link: ReplicaLink | None = None,
    ):
        # not ModelAverager's __init__: its `step` counter is the clock's (`step` below)
        self.process_group, self.traffic, self.clock = mesh.get_group("replicate"), traffic, clock
        self.comm_dtype = getattr(torch, str(comm_dtype))
        # what crosses replicas: the mesh's replicate group, or torchft's Manager under fault tolerance
        self.link = link or MeshLink(self.process_group)
        # this step's exchange did not commit (fault tolerance: a replica was lost in it); the parameters
        # are as they were, so it can be redone (`redo_exchange`)
        self.uncommitted = False

    @classmethod
    def schedule(cls, cfg: DictConfig) -> Schedule:
        """When it exchanges: after the first local step past warmup, then every `period` (PyTorch's
        `PeriodicModelAverager`)."""
        return Schedule(warmup=cfg.warmup_steps, period=config_rules.period_of(cfg)[1], first=1, **pace_keys(cfg))

    @property
    def step(self) -> int:
        """The local steps this replica took (PostLocalSGDOptimizer's checkpoint reads it)."""
        return self.clock.local

    @property
    def checkpoint_part(self):
        """What a checkpoint keeps of this averager (DiLoCo's outer state); None here."""
        return None

    def before_step(self) -> None:
        """Before the local step's forward (DiLoCo applies a delayed sync there)."""
        self.uncommitted = False

    def average_parameters(self, params) -> None:
        tick = self.clock.tick
        if tick.exchange is not None:
            self._average(params, self.link, self.clock.exchange().scale)
            self.clock.exchanged(committed=not self.uncommitted)
            if not self.uncommitted:
                self.clock.applied(tick.exchange)
                self.report_plan()

    def report_plan(self) -> None:
        """The exchange's plan figures (when periods may change) join its row."""
        if row := self.clock.take_row():
            self.traffic.averaged = {**(self.traffic.averaged or {}), **row}

    def _average(self, params, group: ReplicaLink, scale: float | None = None) -> None:
        time_s, nbytes, drift = average_local_shards(params, group, self.comm_dtype, scale)
        self.traffic.add_averaging(nbytes)
        if drift is None:  # a fault-tolerant sync that did not commit: nothing was averaged
            self.uncommitted = True
            self._params = params
        else:
            self.traffic.averaged = {metrics.AVERAGER_DRIFT: drift, metrics.AVERAGER_TIME: time_s}

    def redo_exchange(self) -> None:
        """Redo this step's exchange that did not commit, over the link's quorum as it is now, weighed
        over the replicas in it (fault tolerance, at the run's last step: no later sync would take its
        window in)."""
        self.uncommitted = False
        fragment = self.clock.tick.exchange
        self._average(self._params, self.link, self.clock.reweigh([fragment])[fragment])
        if not self.uncommitted:
            self.clock.applied(fragment)


class HierarchicalReplicaAverager(ReplicaAverager):
    """`HierarchicalModelAverager`'s schedule: at a step past warmup, the largest
    period dividing the step picks the group size to average within.

    The largest period (all replicas) is the clock's exchange; with `averager.balance=time`
    the smaller levels meet within it where the clock puts them: each group at points of
    the plan, at its members' own local steps (`rules.level_meeting`)."""

    config_errors = staticmethod(config_rules.hierarchical_errors)

    def __init__(
        self,
        period_group_size: list[list[int]],
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        clock: Clock,
        comm_dtype: str = "float32",
    ):
        super().__init__(mesh, traffic, clock, comm_dtype)
        sizes = {int(p): int(g) for p, g in period_group_size}
        shards = mesh.get_group("shard")
        self.period_groups = {p: MeshLink(replica_subgroups(mesh, g), shards) for p, g in sizes.items()}

    @classmethod
    def schedule(cls, cfg: DictConfig) -> Schedule:
        """All replicas average after the first local step past warmup that the largest period divides,
        then every largest period; the levels below it meet where theirs divides the step."""
        levels = tuple((int(p), int(g)) for p, g in cfg.period_group_size)
        period = max(p for p, _ in levels)
        first = -(-cfg.warmup_steps // period) * period - cfg.warmup_steps + 1
        return Schedule(warmup=cfg.warmup_steps, period=period, first=first, levels=levels, **pace_keys(cfg))

    def average_parameters(self, params) -> None:
        level = self.clock.tick.level
        if level is not None:
            start = time.perf_counter()
            self._average(params, self.period_groups[level.period], level.scale)  # ends synchronized with the device
            self.clock.waited(time.perf_counter() - start)
        super().average_parameters(params)
