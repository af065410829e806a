"""Post-local SGD's averagers (arXiv 1808.07217): after the local optimizer
step, the *parameters* are averaged across replicas on a schedule; inside a
replica the ranks hold different shards, so nothing is averaged along `shard`.

Both are driven by PyTorch's `PostLocalSGDOptimizer`. Their `step` and
`warmup_steps` are the one clock the gradient hook, the schedule and a
checkpoint read (`synchronous`, `diverged`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.device_mesh import DeviceMesh

from harness import metrics
from harness.averaging import config_rules, schedule
from harness.averaging.collectives import average_local_shards, replica_subgroups
from harness.averaging.link import MeshLink, ReplicaLink
from harness.averaging.pace import Pace, level_meeting, mean_weight
from harness.averaging.traffic import CrossReplicaTraffic


@dataclass(frozen=True)
class RunLength:
    """What a `Pace` needs of the run besides the averager's keys."""

    steps: int  # train.steps
    samples_per_step: int  # one replica's samples per local step (batch × grad_accum × its ranks)
    replicas: int  # of the whole run (fault tolerance: the replica groups)
    replica: int  # this rank's


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
    fragment_count = 1  # syncs per period, each an exchange of a `Pace` (Streaming DiLoCo's fragments)

    def __init__(
        self,
        period: int,
        warmup_steps: int,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        comm_dtype: str = "float32",
        link: ReplicaLink | None = None,
        balance: str = "steps",
        period_schedule: str = "fixed",
        min_period: int = 1,
        run: RunLength | None = None,
    ):
        super().__init__(mesh.get_group("replicate"))
        self.period, self.warmup_steps, self.traffic = period, warmup_steps, traffic
        self.comm_dtype = getattr(torch, str(comm_dtype))
        # what crosses replicas: the mesh's replicate group, or torchft's Manager under fault tolerance
        self.link = link or MeshLink(self.process_group)
        # this step's exchange, to redo, when it did not commit (fault tolerance: a replica was lost in it)
        self.uncommitted: Callable[[], None] | None = None
        # local steps that differ between replicas or periods; None: `period` steps each (periodic_due)
        self.pace = None
        if str(balance) != "steps" or str(period_schedule) != "fixed":
            self.pace = Pace(
                period,
                warmup_steps,
                run.steps,
                balance,
                period_schedule,
                min_period,
                run.replicas,
                run.replica,
                mesh["shard"].get_local_rank() == 0,
                run.samples_per_step,
                torch.device(mesh.device_type),
                first_local_steps=self.first_local_steps(),
                link=self.link,
                fragments=self.fragment_count,
            )

    def first_local_steps(self) -> int:
        """The local steps before the first exchange: post-local SGD averages after the first (periodic_due)."""
        return 1

    @property
    def synchronous(self) -> bool:
        """The step being taken is a warmup step: gradients cross replicas, parameters are not averaged."""
        return schedule.synchronous(self.step, self.warmup_steps)

    @property
    def diverged(self) -> bool:
        """A step so far was local: replicas may hold different parameters and optimizer states."""
        return schedule.diverged(self.step, self.warmup_steps)

    @property
    def checkpoint_part(self):
        """What a checkpoint keeps of this averager besides its step (DiLoCo's outer state); None here."""
        return None

    def crosses_replicas(self) -> bool:
        """The step being taken exchanges anything across replicas (its gradients, or a sync after it)."""
        return self.synchronous or self.group_to_average() is not None

    def group_to_average(self) -> ReplicaLink | None:
        if self.pace is not None:
            return self.link if self.pace.due(self.step) else None
        return self.link if schedule.periodic_due(self.step, self.warmup_steps, self.period) else None

    def average_parameters(self, params) -> None:
        self.uncommitted = None
        group = self.group_to_average()
        if group is not None:
            scale = self.pace.weights(self.pace.exchange(self.step)) if self.pace is not None else None
            self._average(params, group, scale)
            if self.pace is not None:
                self.pace.after_exchange(self.traffic, committed=self.uncommitted is None)
        self.step += 1

    def _average(self, params, group: ReplicaLink, scale: float | None = None) -> None:
        time_s, nbytes, drift = average_local_shards(params, group, self.comm_dtype, scale)
        self.traffic.add_averaging(nbytes)
        if drift is None:  # a fault-tolerant sync that did not commit: nothing was averaged
            self.uncommitted = lambda: self._average(params, group, scale)
        else:
            self.traffic.averaged = {metrics.AVERAGER_DRIFT: drift, metrics.AVERAGER_TIME: time_s}

    def redo_uncommitted(self) -> None:
        """Redo this step's exchange that did not commit, over the link's quorum as it is now (fault
        tolerance, at the run's last step: no later sync would take its window in)."""
        redo, self.uncommitted = self.uncommitted, None
        redo()


class HierarchicalReplicaAverager(ReplicaAverager):
    """`HierarchicalModelAverager`'s schedule: at a step past warmup, the largest
    period dividing the step picks the group size to average within.

    With `averager.balance=time` the Pace plans the largest period (all replicas) as
    post-local SGD's, and the smaller levels meet within it where `level_meeting`
    puts them: each group at points of the plan, at its members' own local steps."""

    config_errors = staticmethod(config_rules.hierarchical_errors)

    def __init__(
        self,
        period_group_size: list[list[int]],
        warmup_steps: int,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        comm_dtype: str = "float32",
        balance: str = "steps",
        period_schedule: str = "fixed",  # adacomm: refused (config_rules), there is no one period to adapt
        min_period: int = 1,
        run: RunLength | None = None,
    ):
        period = max(p for p, _ in period_group_size)
        pace = {"balance": balance, "period_schedule": period_schedule, "min_period": min_period, "run": run}
        super().__init__(period, warmup_steps, mesh, traffic, comm_dtype, **pace)
        self.sizes = {int(p): int(g) for p, g in period_group_size}
        shards = mesh.get_group("shard")
        self.period_groups = {p: MeshLink(replica_subgroups(mesh, g), shards) for p, g in self.sizes.items()}

    def first_local_steps(self) -> int:
        """The local steps to the first average of all replicas: after the first step past warmup that the
        largest period divides."""
        return -(-self.warmup_steps // self.period) * self.period - self.warmup_steps + 1

    def group_to_average(self) -> ReplicaLink | None:
        if self.pace is not None:  # all replicas, at the Pace's exchanges
            return super().group_to_average()
        period = schedule.hierarchical_period(self.step, self.warmup_steps, self.period_groups)
        return None if period is None else self.period_groups[period]

    def average_parameters(self, params) -> None:
        if self.pace is not None and (meeting := self.inner_meeting()) is not None:
            period, scale = meeting
            start = time.perf_counter()
            self._average(params, self.period_groups[period], scale)  # ends synchronized with the device
            self.pace.met(time.perf_counter() - start)
        super().average_parameters(params)

    def inner_meeting(self) -> tuple[int, float | None] | None:
        """The level below all replicas whose group meets after this step, and this replica's scale for
        its weighted mean (`mean_weight`), or None."""
        pace = self.pace
        if pace.syncs == 0:  # before the first exchange every replica takes the same steps: the fixed rule
            period = schedule.hierarchical_period(self.step, self.warmup_steps, self.sizes)
            return (period, None) if period is not None and period < self.period else None
        cut = pace.local_steps if pace.last else None
        taken = self.step - pace.first_step + 1
        meeting = level_meeting(taken, pace.planned(), cut, pace.replica, self.sizes, self.period)
        if meeting is None:
            return None
        period, trained = meeting
        return period, mean_weight(trained, trained[pace.replica % self.sizes[period]])
