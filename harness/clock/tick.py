"""What the clock hands out: the averagers' `Schedule` (when they exchange, in their keys) and a
`Tick` (what one local step of a replica is)."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """When replicas exchange, in the averager's keys (each averager class reads its own config into one:
    `ReplicaAverager.schedule`); the clock plans every period from it."""

    warmup: int  # synchronous steps before the replicas train alone (synchronous training: every step)
    period: int = 1  # local steps between two syncs of the same tensors (hierarchical: the largest period)
    first: int = 1  # local steps past warmup up to the first exchange
    fragments: int = 1  # exchanges per period, each syncing the next fragment of the model (Streaming DiLoCo)
    sync_delay: int = 0  # DiLoCo: local steps from a sync's start to its apply
    levels: tuple[tuple[int, int], ...] = ()  # hierarchical: (period, replicas per group) of each level
    balance: str = "steps"  # time: each replica takes as many local steps as fit in the fastest's period
    period_schedule: str = "fixed"  # adacomm: the period follows the training loss; auto: what exchanges cost
    min_period: int = 1  # adacomm and auto never take a period below it (auto: `period` is its longest)
    comm_budget: float = 0.1  # auto: the share of wall time exchanges may hold training up


SYNCHRONOUS = Schedule(warmup=sys.maxsize)  # no averager: every step's gradients cross replicas


@dataclass(frozen=True)
class Level:
    """A hierarchy's group below all replicas meets after a tick."""

    period: int  # the level's period, which names its group
    scale: float | None  # this replica's scale for the group's weighted mean (None: the plain mean)


@dataclass(frozen=True)
class Tick:
    """One local step of this replica, as the clock has it before the step is taken: everything that
    depends on where the run stands is read here, nowhere else."""

    local: int  # this replica's local steps before it (warmup included): the averager's step
    before: int  # the run's global step before it, where this replica stands
    step: int  # the run's global step once it is taken (equal replicas: before + 1; else it may stay or jump)
    slot: int  # the replica step of the run whose samples it reads (replica steps of all replicas, in order)
    synchronous: bool  # its gradients cross replicas (warmup; synchronous training)
    # the run's first local step (fresh, or resumed where its first period had not begun): before it every
    # replica holds the one model the warmup left, which DiLoCo's outer copy starts from
    starts_alone: bool
    # every replica exchanges after it: the fragment they sync (0 without fragments); at the run's last step
    # (`last`) every fragment, applied at once, so that the run ends with one model
    exchange: int | None
    level: Level | None  # a hierarchy's group below all replicas meets after it
    # DiLoCo: a sync in flight, if any, is applied before it (a delay of 0, one a resume cut short, or one the run's
    # end cuts short: before its last step)
    apply_before: bool
    apply_after: bool  # DiLoCo: the sync in flight is applied after it (its delay ends with it)
    advance: bool  # DiLoCo: after it, a sync in flight starts its second collective (halfway through the delay)
    meeting: bool  # every rank takes it at `step`: log, eval, save and the non-finite report may fall here
    met: int  # the global step of this replica's meeting before it
    last: bool  # this replica's last step of the run

    @property
    def crosses_replicas(self) -> bool:
        """Something crosses replicas in it: its gradients, or an exchange after it (under fault tolerance
        a quorum opens before it)."""
        return self.synchronous or self.exchange is not None

    @property
    def lr_steps(self) -> int:
        """How far the learning-rate schedule moves once it is taken (the rate is a function of the step)."""
        return self.step - self.before

    def reached(self, every: int) -> bool:
        """A multiple of `every` was reached since the meeting before (or this is the last step), so a
        thing done every `every` steps (log, eval, save) falls here. Only a meeting asks."""
        return every > 0 and (self.step // every > self.met // every or self.last)
