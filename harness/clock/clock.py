"""`Clock`: where the run stands, for every part that asks (docs/design.md#one-clock)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness import metrics
from harness.clock.rules import (
    adacomm_period,
    auto_period,
    balanced_local_steps,
    exchange_share,
    fit_to_remaining,
    hierarchical_period,
    level_meeting,
    mean_weight,
    smoothed,
)
from harness.clock.tick import Level, Schedule, Tick
from harness.dist import synchronize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exchange:
    """What an exchange's figures gave this replica."""

    # the fragments it syncs (the tick's, or at the run's last step every one: `Clock.exchange`), each with what
    # this replica scales its tensors of it by before the plain mean (None: the plain mean, bit for bit)
    scales: dict[int, float | None]
    carried: torch.Tensor | None  # the averager's `carried` figures, summed over every rank

    @property
    def scale(self) -> float | None:
        """The scale of an exchange of one fragment (post-local SGD's: the whole model)."""
        (scale,) = self.scales.values()
        return scale


class Figures:
    """Named float64 figures in one tensor, for one sum over every rank; read back in one host copy."""

    def __init__(self, device: torch.device, **sizes: int):
        self.slices, end = {}, 0
        for name, size in sizes.items():
            self.slices[name] = slice(end, end + size)
            end += size
        self.tensor = torch.zeros(end, dtype=torch.float64, device=device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensor[self.slices[name]]

    def read(self) -> dict[str, list[float]]:
        values = self.tensor.tolist()
        return {name: values[where] for name, where in self.slices.items()}


class Clock:
    """The one authority on time in a run. The loop asks it for each local step this replica takes
    (`next`: a `Tick`) and tells it when the step is taken (`advance`); the averagers, the gradient hooks,
    the data stream, the non-finite guard, the fault-tolerance group and the checkpoint read the tick, and
    no part keeps a count of its own.

    Warmup steps are synchronous: every replica takes each of them. After warmup the run is a sequence of
    periods, each ended by an exchange of every replica (the last may be cut to the run's end; its exchange
    syncs every fragment, so the run ends with one model). A period's plan is each replica's local steps in
    it, derived from the schedule and the inputs below at the exchange that starts it, the same on every
    replica; with `balance=steps` and a fixed period it is `period` steps for all, which is PyTorch's and
    DiLoCo's fixed schedule, on this same path.

    The run's progress is counted in replica steps (local steps of all replicas: a replica's samples
    over its batch); the global step is that count over the replicas, so a replica i steps into a period
    of its own k stands at the global step i/k of the way from the period's start to its end. The
    global step is what the learning-rate schedule, log, eval and checkpoint names follow.

    Its checkpoint part holds inputs, never the plan: the progress (replica steps before the period
    under way, each replica's steps in it, exchanges so far, the steps each replica's tensors hold), the
    measurements (each replica's step time, the exposed exchange time, the first step's and the last exchange's
    mean loss). A resume
    derives the plan again for the run it is in: exact when nothing changed, defined when something did
    (docs/configuration.md#changing-a-run-at-resume)."""

    def __init__(
        self,
        schedule: Schedule,
        steps: int,
        replicas: int,
        replica: int,
        leads: bool,
        samples_per_step: int,
        device: torch.device,
        sum_over_replicas: Callable[[torch.Tensor], None] | None = None,
        *,
        sum_in_world: Callable[[torch.Tensor], None] = dist.all_reduce,
        now: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        exchange_delay_s: float = 0.0,
    ):
        """`steps`: train.steps; `replicas`: the run's (fault tolerance: the replica groups), `replica`:
        this rank's; `leads`: this rank writes its replica's figures (its first shard); `samples_per_step`:
        one replica's samples per local step; `sum_over_replicas`: completes a sum over this world across
        the replica groups it does not hold (fault tolerance), else None. `sum_in_world` sums a tensor over
        every rank of this world, `now` times steps and `wall` stamps arrivals: torch.distributed and the
        host's clocks, which the clock's model-based tests replace by replicas of their own.
        `exchange_delay_s`: each exchange held up that long on every rank, a slower link simulated (a test knob:
        `HARNESS_TEST_EXCHANGE_DELAY`, harness/slowdown.py)."""
        self.schedule, self.steps, self.replicas, self.replica = schedule, steps, replicas, replica
        self.leads, self.samples_per_step, self.device = leads, samples_per_step, device
        self.sum_over_replicas = sum_over_replicas
        self.sum_in_world, self.now, self.wall, self.exchange_delay_s = sum_in_world, now, wall, exchange_delay_s
        self.balances = str(schedule.balance) == "time"
        self.adapts = str(schedule.period_schedule) == "adacomm"
        self.auto = str(schedule.period_schedule) == "auto"
        self.plans = self.balances or self.adapts or self.auto  # exchanges share figures, and periods may change
        fragments = schedule.fragments
        self.stride = schedule.period // fragments  # local steps between two exchanges (auto: the most)
        # AdaComm's and auto's shortest: `min_period` in strides, and longer than DiLoCo's delay (a sync is applied
        # before the next one starts, and its fragment trains a step after it before that)
        self.min_stride = max(1, math.ceil(schedule.min_period / fragments), schedule.sync_delay + 1)
        # inputs (the checkpoint part): progress ...
        self.done = 0  # replica steps of the run before the period under way (in warmup: so far)
        self.taken = 0  # this replica's local steps in the period under way
        self.syncs = 0  # exchanges so far: the next syncs fragment `syncs % fragments`
        self.trained = [0] * replicas  # each replica's local steps before the period under way
        # each fragment's local steps in each replica's tensors since its sync was last applied
        self.held = [[0] * replicas for _ in range(fragments)]
        # ... and measurements
        self.step_times: list[float | None] = [None] * replicas  # smoothed, each replica's own steps
        self.exchange_time: float | None = None  # smoothed: the time an exchange holds training up (auto)
        self.first_loss: float | None = None  # F₀: the ranks' mean loss at the run's first step (adacomm)
        self.first_loss_shared = sum_over_replicas is None  # F₀ is the mean over every replica group too
        self.exchange_loss: float | None = None  # F at the exchange that planned the period under way
        # derived
        self.step = 0  # the run's global step where this replica stands
        self.met = 0  # the global step of this replica's last meeting
        self.planned: list[int] | None = None  # each replica's local steps in the period under way ...
        self.plan: list[int] | None = None  # ... cut to the run's end (None in warmup)
        self.cut = False
        self.in_step = True  # every replica takes the period's steps at the same global steps (equal plans)
        self.anchor = (0, 0)  # (local steps, global step) where the period under way was entered
        self.entered: list[int] = [0] * replicas  # each replica's steps in the period under way when it was entered
        self.chosen: int | None = None  # the stride auto last said it chose (this process's)
        self._replan()
        # this process's
        self.tick: Tick | None = None  # the step being taken
        self.asked_first_loss = False  # F₀ was asked for at a step of this process (adacomm)
        self.loaded: list[int] | None = None  # each replica's steps in the period, as loaded, until the next tick
        self.loss: torch.Tensor | None = None  # the loss of the step being taken (adacomm's F, read at exchanges)
        self.started: float | None = None  # when this period's local steps began (None: not measured)
        self.idle_s = 0.0  # ... and of the time since, meetings within it (a hierarchy's groups, quorums)
        self.arrived: float | None = None  # the wall time this replica began waiting for the exchange ahead
        self.computed_at = 0.0  # when the compute of its last step before the exchange ahead ended
        self.timer_due = False  # a period began: its timer starts at the next tick (after log, eval and save)
        self.rejoined = False  # healed (fault tolerance): its step time restarts from its peers'
        self.staged: tuple | None = None  # an exchange's figures, until it commits
        self.counted = False  # the exchange ahead's steps are counted (`exchanged`)
        self.row: dict = {}  # the last committed exchange's figures, until its row takes them
        self.exposed_s = 0.0  # time exchanges held this replica up since its figures were last shared (auto)
        self.exchange_began: float | None = None  # when the exchange under way began, once every replica was there

    # -- where the run stands --------------------------------------------------------------------

    @property
    def warming(self) -> bool:
        """The run is in its synchronous warmup (at a period's boundary: a period under way ends first)."""
        return self.taken == 0 and self.done // self.replicas < self.schedule.warmup

    @property
    def finished(self) -> bool:
        return self.step >= self.steps

    @property
    def diverged(self) -> bool:
        """A step so far was local: replicas may hold different parameters and optimizer states (a
        checkpoint keeps a copy per replica; after the run's last exchange their parameters are one model,
        their optimizer states still their own)."""
        return self.local > self.schedule.warmup

    @property
    def local(self) -> int:
        """This replica's local steps so far (warmup included): the averager's step."""
        return self.trained[self.replica] + self.taken

    @property
    def final(self) -> bool:
        """The period under way ends the run."""
        return self.done + sum(self.plan) >= self.steps * self.replicas

    def _step_at(self, taken: int) -> int:
        """This replica's global step after `taken` local steps of the period under way: on the line from
        the period's start (or the point a resume entered it at) to its end."""
        if self.plan is None:
            return self.done // self.replicas
        since, start = self.anchor
        mine = self.plan[self.replica]
        if taken >= mine and since >= mine:  # entered complete: the run's end
            return start
        end = self.steps if self.final else max(start, (self.done + sum(self.plan)) // self.replicas)
        return start + (taken - since) * (end - start) // (mine - since)

    def _slot(self, taken: int) -> int:
        """The slot of this replica's step after `taken` local steps of the period under way: in a period,
        the replicas' i-th steps follow each other in replica order, those that already took all theirs
        left out, so equal replicas read as synchronous ones do."""
        if self.plan is None:
            return self.done + self.replica
        before = sum(min(k, taken) for k in self.plan)
        return self.done + before + sum(k > taken for k in self.plan[: self.replica])

    @property
    def synchronous(self) -> bool:
        """The gradients of the step being taken cross replicas (between steps, as a bench's backward outside
        the loop: the next step's)."""
        return self.tick.synchronous if self.tick is not None else self.warming

    def slot(self) -> int:
        """The slot the step being taken reads (between steps, as a bench reads a batch outside the loop:
        the next step's)."""
        return self.tick.slot if self.tick is not None else self._slot(self.taken)

    def next_slot(self) -> int:
        """The slot of the tick after the one being taken, for reading ahead: exact, unless a heal or a
        resume moves the run (the reader then reads again)."""
        if self.plan is None or self.taken + 1 == self.plan[self.replica]:
            after = self.done + (self.replicas if self.plan is None else sum(self.plan))
            return after + self.replica  # the next period's first step, whatever its plan
        return self._slot(self.taken + 1)

    def consumed(self) -> int:
        """Replica steps of the run so far, where every replica's position is known (a save, a heal)."""
        return self.done + sum(self.positions())

    def positions(self) -> list[int]:
        """Every replica's local steps in the period under way, as this replica's position tells them where
        every rank meets: at the period's start none; before the exchange that ends it (a heal's quorum)
        one short of each plan; at the run's end each plan; with equal plans its own."""
        if self.loaded is not None:
            return list(self.loaded)
        if self.plan is None or self.taken == 0 and (self.tick is None or self.tick.exchange is None):
            return [0] * self.replicas
        if self.tick is not None and self.tick.exchange is not None:
            return [k - 1 for k in self.plan]
        mine = self.plan[self.replica]
        if self.taken == mine:
            return list(self.plan)
        return [self.taken * k // mine for k in self.plan]  # equal plans: its own (only there, between meetings)

    def delay(self, replica: int) -> int:
        """A replica's local steps from a DiLoCo sync's start to its apply: `sync_delay` while the replicas
        are in step (each stage of the sync on the same tick everywhere; one due past the run's end dropped
        by all alike); else the same share of its steps in the period as `sync_delay` is of the fastest's
        (rounded down, before its last step of the period), so every replica applies after about the same wall
        time, a replica planned fewer steps than the delay applies before its next step, losing none of them,
        and in the run's cut last period every replica applies before its last step, whose meeting of every
        rank comes after the sync's collectives on each."""
        tau = self.schedule.sync_delay
        if tau == 0 or self.plan is None or self.in_step:
            return tau
        k = self.plan[replica]
        return min(k - 1, tau * k // max(self.plan))

    # -- the steps ---------------------------------------------------------------------------------

    def next(self) -> Tick:
        """What this replica's next local step is (the step being taken until `advance`)."""
        self.loaded = None
        if self.timer_due:  # the period's local steps start now: its exchange's log, eval and save are left out
            self.timer_due = False
            self.started = self.now() if self.syncs >= 2 else None  # the run's first periods hold start-up
            self.idle_s, self.arrived = 0.0, None
        before, local = self.step, self.local
        if self.warming:
            step = before + 1
            self.tick = Tick(
                local=local,
                before=before,
                step=step,
                slot=self._slot(0),
                synchronous=True,
                starts_alone=False,
                exchange=None,
                level=None,
                apply_before=False,
                apply_after=False,
                advance=False,
                meeting=True,
                met=self.met,
                last=step >= self.steps,
            )
            return self.tick
        taken, mine = self.taken + 1, self.plan[self.replica]
        ends = taken == mine
        exchange = self.syncs % self.schedule.fragments if ends else None  # a cut last period's too
        last = ends and self.final
        delay, delayed = self.delay(self.replica), self.schedule.sync_delay > 0 and self.syncs > 0
        self.tick = Tick(
            local=local,
            before=before,
            step=self._step_at(taken),
            slot=self._slot(self.taken),
            synchronous=False,
            starts_alone=self.syncs == 0 and self.taken == 0,
            exchange=exchange,
            level=None if exchange is not None else self._level(taken),
            # a sync in flight is applied once its delay is over: after the step it ends with; before a step when a
            # resume (a checkpoint holds a sync just started) entered the period past it, a delay of 0 included; and
            # before the run's last step when the run ends first (that step's exchange starts with no collective in
            # flight: under fault tolerance its quorum opens before it)
            apply_before=self.syncs > 0 and (self.taken >= delay or last),
            apply_after=delayed and delay >= 1 and taken == delay,
            advance=delayed and delay >= 2 and taken == delay - delay // 2,
            # replicas in step meet at every step; with balance=time only at exchanges: a collective between
            # them (a log's mean) would make a fast replica wait for a slow one inside its measured step times
            meeting=self.in_step and not self.balances or exchange is not None or last,
            met=self.met,
            last=last,
        )
        return self.tick

    def _level(self, taken: int) -> Level | None:
        """The hierarchy's group below all replicas that meets after this replica's `taken`-th step."""
        levels = dict(self.schedule.levels)
        if not levels:
            return None
        if len(set(self.plan)) == 1:  # replicas in step: PyTorch's rule, on the step every replica is at
            below = [p for p in levels if p < self.schedule.period]
            period = hierarchical_period(self.step, below)
            return None if period is None else Level(period, None)
        cut = self.plan if self.cut else None
        meeting = level_meeting(taken, self.planned, cut, self.replica, levels, self.schedule.period)
        if meeting is None:
            return None
        period, held = meeting
        return Level(period, mean_weight(held, held[self.replica % levels[period]]))

    def computed(self, loss: torch.Tensor) -> None:
        """The step's forward and backward are done, `loss` its loss (a device tensor, read at the next exchange:
        AdaComm's F). Before an exchange this replica's period ends here, ahead of anything that waits for the
        others (the host's finite check, the exchange's own collectives). On the first step with no F₀ (a fresh
        run, or one resumed without it) F₀ is the ranks' mean of `loss`, read now: every rank takes its first
        step once, so the collective pairs up; while it is not finite, again at each meeting (under fault
        tolerance the groups' means meet at the first exchange)."""
        if self.plans and self.tick.exchange is not None:
            synchronize(self.device)  # the step time ends at finished work
            self.computed_at = self.now()
            self.waiting()
        if self.adapts:
            self.loss = loss
            # every rank asks at its first step and at every meeting after, so the sums pair up, until one is
            # finite (a non-finite first loss, skipped under train.nonfinite=skip, would leave F₀ NaN for good)
            if self.first_loss is None and (not self.asked_first_loss or self.tick.meeting):
                self.asked_first_loss = True
                first = loss.detach().to(torch.float64)
                figures = torch.stack([first, torch.ones_like(first)])
                self.sum_in_world(figures)
                total, ranks = figures.tolist()
                self.first_loss = total / ranks if math.isfinite(total) else None

    def advance(self) -> None:
        """The step being taken is done (its optimizer step, its averaging): the run moves to its step."""
        tick, self.tick = self.tick, None
        if tick.meeting:
            self.met = tick.step
        if tick.synchronous:
            self.done += self.replicas
            self.trained = [k + 1 for k in self.trained]
            if not self.warming:  # the first period begins
                self.anchor = (0, self.done // self.replicas)
                self._replan()
        elif tick.exchange is not None:
            if not self.counted:  # no averager took part (the exchange had nothing to do): every replica its plan
                self._count(list(self.plan))
            self.counted = False
            self.done += sum(self.plan)
            self.taken, self.syncs, self.timer_due = 0, self.syncs + 1, True
            self.anchor = (0, self.done // self.replicas)
            self._replan()
        else:
            self.taken += 1
        self.step = tick.step

    def _replan(self, positions: list[int] | None = None) -> None:
        """The period under way's plan, from the inputs: the fastest replica takes the period in force
        (the first period: the schedule's first), the others what fits in its time; cut to the run's end.
        `positions`: each replica's steps in it already (a resume), which a changed plan cannot undo: one
        that took all its new plan takes one more, and the exchange follows."""
        if self.warming:
            self.planned = self.plan = None
            self.cut = False
            return
        stride = self._stride()
        if self.syncs == 0:  # the schedule's first (auto: no longer than what it would choose)
            stride = min(self.schedule.first, stride) if self.auto else self.schedule.first
        if self.balances:
            self.planned = balanced_local_steps(stride, self.step_times)
        else:
            self.planned = [stride] * self.replicas
        remaining = self.steps * self.replicas - self.done
        self.plan, self.cut = fit_to_remaining(self.planned, max(remaining, 1))
        if positions is not None and self.done + sum(positions) < self.steps * self.replicas:
            self.plan = [k if t < k else t + 1 for k, t in zip(self.plan, positions)]
        self.in_step = len(set(self.plan)) == 1 and len(set(positions or [0])) == 1
        self.entered = list(positions or [0] * self.replicas)

    def _stride(self) -> int:
        """The local steps between exchanges in force: AdaComm's from the last exchange's loss, auto's from what
        exchanges cost, else the schedule's."""
        if self.adapts and self.exchange_loss is not None and self.first_loss is not None:
            return adacomm_period(self.exchange_loss, self.first_loss, self.stride, self.min_stride)
        if self.auto:
            step_s = self._period_step_time()
            stride = auto_period(self.exchange_time, step_s, self.schedule.comm_budget, self.min_stride, self.stride)
            # said when it moves by half or more from the period last said (a measurement's noise moves it by one)
            if self.leads and self.replica == 0 and (self.chosen is None or not 2 / 3 < stride / self.chosen < 1.5):
                log.info(self._why(stride, step_s))
                self.chosen = stride
            return stride
        return self.stride

    def _period_step_time(self) -> float | None:
        """The time of a period's local step, the one a period's wall time follows: the fastest replica's with
        balance=time (the others take what fits in its time), else the slowest's (the others wait for it)."""
        known = [t for t in self.step_times if t is not None]
        if not known:
            return None
        return min(known) if self.balances else max(known)

    def _why(self, stride: int, step_s: float | None) -> str:
        """auto's log line: the period it chose, and why."""
        f, budget = self.schedule.fragments, self.schedule.comm_budget
        chose = f"averager.period=auto: period {stride * f}"
        if self.exchange_time is None or step_s is None:
            return f"{chose} (the shortest it may take) until an exchange and a period's steps are measured"
        share = exchange_share(self.exchange_time, step_s, stride)
        bound = ""
        if stride == self.min_stride:
            bound = ", the shortest it may take"
        elif stride == self.stride:
            bound = ", the longest it may take (averager.max_period)"
        return (
            f"{chose}{bound}: an exchange holds training up {self.exchange_time:.3g} s and a local step takes "
            f"{step_s:.3g} s, so exchanges take {share:.1%} of the wall time (averager.comm_budget={budget:g})"
        )

    # -- exchanges ---------------------------------------------------------------------------------

    def waiting(self) -> None:
        """This replica begins waiting for its peers at the exchange ahead (fault tolerance: the quorum
        before its last step of the period): its arrival, for the wait figures."""
        if self.arrived is None:
            self.arrived = self.wall()

    def waited(self, seconds: float) -> None:
        """Time this replica spent on other things than its steps within the period (a hierarchy's group
        meeting, waits for a slower member included; a quorum; an async save's staging): step times leave
        it out, so a replica is planned by its own speed."""
        self.idle_s += seconds

    def exchange(self, carried: torch.Tensor | None = None, skip_untrained: bool = False) -> Exchange:
        """At the exchange after the step being taken, every replica's: when the plan may change, the
        figures it is derived from, in one small sum over every rank (the exchange is the one moment every
        rank is there anyway), with an averager's `carried` float64 figures. Returns this replica's scale
        for the weighted mean of the fragment it syncs: each replica weighted by the local steps its tensors
        hold (since that fragment's sync was last applied), among the replicas that trained (fault
        tolerance: a group outside the quorum took none); at the run's last step, a scale for each fragment
        it syncs: every fragment, but with `skip_untrained` those no replica trained since their sync was
        applied (DiLoCo with `averager.mix` 0: the outer update replaced them, on every replica alike)."""
        completed = list(self.plan)
        summed, staged = None, None
        if self.plans:
            figures = self._share(carried)
            completed = [int(k) for k in figures["completed"]]
            summed = torch.tensor(figures["carried"], dtype=torch.float64) if carried is not None else None
            staged = figures
        # every replica is here, and the figures' host read waited for this device's queue (on CUDA the step's
        # optimizer kernels): from now the exchange holds each up, waiting for no peer and no compute
        if self.auto:
            self.exchange_began = self.now()
        if self.exchange_delay_s:
            time.sleep(self.exchange_delay_s)
        members = [q for q in range(self.replicas) if completed[q] > 0]
        scales = {}
        for fragment in self._synced():
            held = [h + k for h, k in zip(self.held[fragment], completed)]
            if self.tick.last and skip_untrained and not any(held[q] > 0 for q in members):
                continue  # no replica trained it since its sync was applied: one model already
            mine = held[self.replica]
            scales[fragment] = mean_weight([held[q] for q in members], mine) if self.replica in members else None
        self.staged = (completed, staged)
        return Exchange(scales, summed)

    def _synced(self) -> list[int]:
        """The fragments the exchange after the step being taken may sync: its fragment, or at the run's last
        step every fragment (the run ends with one model)."""
        return list(range(self.schedule.fragments)) if self.tick.last else [self.tick.exchange]

    def _share(self, carried: torch.Tensor | None) -> dict[str, list[float]]:
        now, mine, r, n = self.computed_at, self.taken + 1, self.replica, self.replicas
        extra = 0 if carried is None else carried.numel()
        figures = Figures(
            self.device, step_time=n, arrival=n, completed=n, exchange_time=n, loss=2, first_loss=2, carried=extra
        )
        if self.leads:  # one figure per replica; a step time of -1: restarted, take the peers' median
            if self.rejoined:
                figures["step_time"][r] = -1.0
            elif self.started is not None:
                figures["step_time"][r] = (now - self.started - self.idle_s) / mine
            figures["arrival"][r] = self.arrived  # wall clock: comparable across hosts (to their clocks' sync)
            figures["completed"][r] = mine
            figures["exchange_time"][r] = self.exposed_s  # the exchanges since the last share (0: not measured here)
        if self.adapts and self.loss is not None:
            figures["loss"][0] = self.loss.detach().to(torch.float64)
            figures["loss"][1] = 1.0
        if not self.first_loss_shared and self.first_loss is not None:
            figures["first_loss"][0], figures["first_loss"][1] = self.first_loss, 1.0
        if carried is not None:  # the sums are the averager's, on this stream: read below, after the sum
            figures["carried"].copy_(carried)
        self.exposed_s = 0.0
        self.sum_in_world(figures.tensor)  # every rank of the world is at this exchange
        if self.sum_over_replicas is not None:
            self.sum_over_replicas(figures.tensor)  # and every replica group in the quorum (fault tolerance)
        return figures.read()

    def exchanged(self, committed: bool) -> None:
        """The exchange's averaging is over. `committed`: it took effect (fault tolerance: a group lost in
        it undoes it, and its figures may be a part of the quorum's: the plan keeps its inputs, and every
        replica counts as having taken its planned steps)."""
        completed, figures = self.staged
        self.staged = None
        if self.auto and self.exchange_began is not None:  # the averagers end their exchange synchronized
            self.exposed_s += self.now() - self.exchange_began
            self.exchange_began = None
        self._count(completed if committed else list(self.plan))
        if figures is not None and committed:
            self._measured(figures, completed)

    def held_up(self, seconds: float) -> None:
        """An exchange held this replica up inside a period (a DiLoCo sync's second collective or the wait at its
        apply: what its overlap did not hide; the quorum before an exchange, fault tolerance): not a step's
        time, and under auto an exchange's cost."""
        self.idle_s += seconds
        if self.auto:
            self.exposed_s += seconds

    def _count(self, completed: list[int]) -> None:
        """The period's local steps, each replica's, into what it trained and what its tensors hold."""
        self.trained = [a + k for a, k in zip(self.trained, completed)]
        self.held = [[h + k for h, k in zip(held, completed)] for held in self.held]
        self.counted = True

    def _measured(self, figures: dict[str, list[float]], completed: list[int]) -> None:
        """A committed exchange's figures become the plan's inputs, and its row."""
        n = self.replicas
        # the period that ended, as taken: its longest replica's steps (the first period's, a cut last one's too)
        self.row = {metrics.AVERAGER_PERIOD: max(completed) * self.schedule.fragments}
        for q, t in enumerate(figures["step_time"]):
            if t > 0:
                self.step_times[q] = smoothed(self.step_times[q], t)
            elif t < 0:  # a group restarted and healed since the last exchange
                others = [x for p, x in enumerate(self.step_times) if p != q and x is not None]
                self.step_times[q] = statistics.median(others) if others else None
        self.rejoined = False
        exposed = [t for t in figures["exchange_time"] if t > 0]  # the least: the one that waited for no peer's link
        if exposed:
            self.exchange_time = smoothed(self.exchange_time, min(exposed))
        step_s = self._period_step_time()
        if self.auto and self.exchange_time is not None and step_s is not None:
            self.row[metrics.AVERAGER_EXCHANGE_TIME] = self.exchange_time
            self.row[metrics.AVERAGER_EXCHANGE_SHARE] = exchange_share(self.exchange_time, step_s, max(completed))
        latest = max(figures["arrival"])
        for q in (q for q in range(n) if completed[q]):
            name = str(q)
            self.row[metrics.REPLICA_LOCAL_STEPS.named(name)] = completed[q]
            self.row[metrics.REPLICA_SAMPLES.named(name)] = self.trained[q] * self.samples_per_step
            self.row[metrics.REPLICA_WAIT.named(name)] = latest - figures["arrival"][q]
            if figures["step_time"][q] > 0:
                self.row[metrics.REPLICA_STEP_TIME.named(name)] = figures["step_time"][q]
        loss, ranks = figures["loss"]
        if self.adapts and ranks:
            self.exchange_loss = loss / ranks
        first, groups = figures["first_loss"]
        if groups:
            self.first_loss, self.first_loss_shared = first / groups, True

    def take_row(self) -> dict:
        """The last committed exchange's figures (balance=time, adacomm), once."""
        row, self.row = self.row, {}
        return row

    def applied(self, fragment: int, delayed: bool = False) -> None:
        """The mean of `fragment`'s sync is in: each replica's tensors of it hold no local step of their own
        now. A delayed DiLoCo sync is applied at each replica's own step, after its `delay` (or where a resume
        entered the period past it, or before its last step of the run when the run ends first): the local steps
        it took since the sync started count against what its tensors hold (with `averager.mix` 0 their progress
        was replaced)."""
        if not delayed:
            self.held[fragment] = [0] * self.replicas
            return
        self.held[fragment] = [
            -min(max(self.delay(q), self.entered[q]), self.plan[q] - 1) for q in range(self.replicas)
        ]

    def reweigh(self, fragments: list[int]) -> dict[int, float | None]:
        """This replica's scale for each of `fragments`, synced by the exchange after the step being taken,
        redone among the replicas in the quorum now (fault tolerance, at the run's last step): weighed over
        those alone."""
        if not self.plans:
            return dict.fromkeys(fragments)
        figures = Figures(self.device, held=len(fragments), members=1)
        if self.leads:
            figures["held"].copy_(torch.tensor([float(self.held[f][self.replica]) for f in fragments]))
            figures["members"][0] = 1.0
        self.sum_in_world(figures.tensor)
        self.sum_over_replicas(figures.tensor)
        values = figures.read()
        members, scales = values["members"][0], {}
        for fragment, total in zip(fragments, values["held"]):
            scale = self.held[fragment][self.replica] * members / total if total > 0 else None
            scales[fragment] = None if scale == 1.0 else scale
        return scales

    # -- its checkpoint part -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The inputs (the same on every rank where every rank meets: a save, a heal)."""
        return {
            "replicas": self.replicas,
            "done": self.done,
            "taken": self.positions(),
            "syncs": self.syncs,
            "trained": list(self.trained),
            "held": [list(h) for h in self.held],
            "step_times": list(self.step_times),
            "exchange_time": self.exchange_time,
            "first_loss": self.first_loss,
            "first_loss_shared": self.first_loss_shared,
            "exchange_loss": self.exchange_loss,
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's (or a healing peer's) inputs, and the plan derived again for this run: more or
        fewer steps cut the period under way elsewhere; a new period, schedule or balance plans it anew
        (a replica that already took its new plan takes one more step to the exchange); another replica
        count keeps the global step and starts the period under way afresh where the replicas were apart."""
        n, saved = self.replicas, state["replicas"]
        self.syncs, self.exchange_loss = state["syncs"], state["exchange_loss"]
        self.exchange_time = state["exchange_time"]
        self.first_loss = state["first_loss"]
        self.first_loss_shared = state["first_loss_shared"] or self.sum_over_replicas is None
        taken = list(state["taken"])
        held = state["held"]
        if saved == n:
            self.done, self.trained, self.step_times = state["done"], list(state["trained"]), list(state["step_times"])
            fresh = len(held) != self.schedule.fragments
            self.held = [[0] * n for _ in held] if fresh else [list(h) for h in held]
        else:  # the global step stays; each replica's figures start afresh
            step, together = (state["done"] + sum(taken)) // saved, len(set(taken)) == 1
            common = taken[0] if together else 0
            self.done, taken = (step - common) * n, [common] * n
            self.trained, self.step_times = [step - common] * n, [None] * n
            self.held = [[0] * n for _ in range(self.schedule.fragments)]
        if len(self.held) != self.schedule.fragments:
            self.held = [[0] * n for _ in range(self.schedule.fragments)]
        if state["step"] < self.schedule.warmup:  # synchronous from here (averager=none; a warmup not over yet)
            self.done, taken = state["step"] * n, [0] * n
        self.taken, self.tick, self.loaded = taken[self.replica], None, taken
        self._replan(positions=taken)
        # from the step it was saved or sent at (a heal before an exchange: the sender's, at its own point of the
        # period), which the learning-rate schedule and the data position it came with also stand at
        self.anchor = (self.taken, state["step"])
        self.step = self._step_at(self.taken)
        partway = self.plan is not None and 0 < self.taken < self.plan[self.replica]
        self.met = self.done // n if self.balances and partway else self.step
        self.started, self.timer_due = None, self.taken == 0  # at a period's start its timer starts with it
