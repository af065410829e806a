"""How many local steps each replica takes between two exchanges: `averager.balance`
and `averager.period_schedule` (docs/configuration.md#uneven-replicas).

`balance=steps` with `period_schedule=fixed` is `schedule.periodic_due` alone: no
`Pace` is built. Otherwise the averager asks a `Pace`, which plans each period at
the exchange that starts it, from figures every rank shares there in one small
all-reduce (the exchange is the one moment every rank is there anyway):

- `period_schedule=adacomm` (Wang & Joshi, SysML 2019): the period is
  ⌈√(F/F₀)·τ₀⌉, τ₀ = `averager.period`, F the ranks' mean training loss at
  this exchange, F₀ their mean loss at the run's first step (the paper's
  F(x₀); a run resumed from a checkpoint without it: its first step's); never
  below `averager.min_period`, never above τ₀.
- `balance=time` (the dynamic local updates of Liu et al., arXiv 2401.09135): the
  fastest replica takes `period` local steps and each other as many as fit in the
  same time, from each replica's smoothed step time (local steps only, measured
  from the end of one exchange's step (its log, eval and save included) to the
  arrival at the next, from the second period on: the first holds the run's own
  start-up); a replica within
  `DEAD_BAND` of the fastest takes `period` too, so equal replicas train exactly
  what `balance=steps` trains. The average weighs each replica by the local steps
  (samples) it trained since the last exchange.

With Streaming DiLoCo's `fragments` F, each fragment's sync is an exchange: the
plan is made per stride of period/F local steps (`period`, `min_period` and
AdaComm's period move in strides), the k-th exchange syncs fragment k mod F, and a
fragment's weights are the local steps each replica trained since that
fragment's last sync (its last F strides).

The run's progress is counted in local steps of all replicas (`done`: samples
over one replica's batch): the global step is `done / replicas`, so equal
replicas count as `balance=steps` does, and a replica at local step i of a period
stands at the global step interpolated between the period's two ends. The run's
last period is cut to what remains of `train.steps` (every replica at least one
step) and ends without an exchange, as a cut period does under `balance=steps`.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from harness import metrics
from harness.dist import synchronize

DEAD_BAND = 0.25  # a replica up to 25 % slower than the fastest still takes `period` steps: timing noise
SMOOTHING = 0.5  # weight of the newest period in a replica's step time


def adacomm_period(loss: float, first_loss: float, period: int, min_period: int) -> int:
    """AdaComm's period for a training loss `loss` against the run's first step's `first_loss`."""
    if not (math.isfinite(loss) and math.isfinite(first_loss)) or first_loss <= 0 or loss < 0:
        return period
    return max(min_period, min(period, math.ceil(math.sqrt(loss / first_loss) * period)))


def balanced_local_steps(period: int, step_times: list[float | None]) -> list[int]:
    """Each replica's local steps for a period: the fastest takes `period`, the others as many as
    fit in its time (at least 1); `period` for all while a replica's time is unknown."""
    if any(t is None for t in step_times):
        return [period] * len(step_times)
    fastest = min(step_times)
    return [period if t <= fastest * (1 + DEAD_BAND) else max(1, round(period * fastest / t)) for t in step_times]


def fit_to_remaining(local_steps: list[int], remaining: int) -> tuple[list[int], bool]:
    """`local_steps`, or, when they exceed the `remaining` local steps of the run, shares of it in
    the same proportions (largest remainder; each at least 1); True when cut."""
    total = sum(local_steps)
    if total <= remaining:
        return local_steps, False
    quotas = [k * remaining / total for k in local_steps]
    shares = [max(1, math.floor(q)) for q in quotas]
    by_remainder = sorted(range(len(shares)), key=lambda r: quotas[r] - math.floor(quotas[r]), reverse=True)
    for r in by_remainder[: max(0, max(remaining, len(shares)) - sum(shares))]:
        shares[r] += 1
    return shares, True


def mean_weight(trained: list[int], mine: int) -> float | None:
    """What a member that trained `mine` of the members' `trained` local steps scales its tensors by
    before their plain mean, so that the mean weighs each member by its steps; None (the plain mean,
    bit for bit) when they trained alike."""
    if len(set(trained)) == 1:
        return None
    return mine * len(trained) / sum(trained)


def level_meeting(
    taken: int, planned: list[int], cut: list[int] | None, replica: int, sizes: dict[int, int], period: int
) -> tuple[int, list[int]] | None:
    """Hierarchical averaging's levels below all replicas, in a period of `balance=time`: the fastest
    replica's `period` local steps split at each multiple of the smallest level's period make
    m = period/smallest meeting points (the m-th: the exchange of all replicas), and a replica that
    takes k steps in the period, at an even speed, reaches the i-th after ⌊i·k/m⌋ of them. So the
    members of a group arrive together, and no group waits for another: the points come from the plan
    every replica holds. A point is held when each member of its level's group (`sizes`: period ->
    replicas per group, consecutive replicas) trained since the point before (a member still inside
    a step would stall the others) and, in the run's last period, cut to `cut`, reaches it.

    After this replica's `taken`-th local step of the period: the level (its period) whose group meets,
    and each member's local steps since that group, or one above it, last met (the period's start: an
    exchange of all); or None."""
    smallest = min(sizes)
    meetings, start = period // smallest, {p: replica // g * g for p, g in sizes.items()}

    def reached(q: int, point: int) -> int:
        return planned[q] * point // meetings

    def level(point: int) -> int:  # the largest period the point falls on (periods nest: config_rules)
        return max(p for p in sizes if point * smallest % p == 0)

    def members(p: int) -> range:
        return range(start[p], start[p] + sizes[p])

    def held(point: int) -> bool:
        return all(
            reached(q, point) > reached(q, point - 1) and (cut is None or cut[q] >= reached(q, point))
            for q in members(level(point))
        )

    point = math.ceil(taken * meetings / planned[replica])
    if point >= meetings or reached(replica, point) != taken or not held(point):
        return None
    p = level(point)
    last = next((j for j in range(point - 1, 0, -1) if level(j) >= p and held(j)), 0)
    return p, [reached(q, point) - reached(q, last) for q in members(p)]


class Pace:
    """This replica's side of the plan: when it exchanges next, and where the run stands."""

    def __init__(
        self,
        period: int,
        warmup_steps: int,
        total_steps: int,
        balance: str,
        period_schedule: str,
        min_period: int,
        replicas: int,
        replica: int,
        leads_replica: bool,
        samples_per_step: int,
        device: torch.device,
        first_local_steps: int = 1,
        link=None,
        fragments: int = 1,
    ):
        # in strides: the local steps between two exchanges (with one fragment, the period)
        stride = period // fragments
        self.base_period, self.period, self.min_period = stride, stride, max(1, math.ceil(min_period / fragments))
        self.fragments = fragments
        self.syncs = 0  # exchanges of the run so far: the next one syncs fragment `syncs % fragments`
        self.windows: list[list[int]] = []  # each replica's local steps in the last `fragments` exchanges
        self.balances, self.adapts = str(balance) == "time", str(period_schedule) == "adacomm"
        self.replicas, self.replica, self.leads = replicas, replica, leads_replica
        self.samples_per_step, self.device = samples_per_step, device
        # the replicas beyond this world (fault tolerance: torchft's Manager sums over the groups in the quorum)
        self.link = link
        self.total = total_steps * replicas  # the run's length in local steps of all replicas
        # the period under way: each replica's local steps (before the first exchange: the averager's own
        # rule), the run's progress at its start, and this replica's first averager step in it
        self.local_steps = [first_local_steps] * replicas
        self.start_done, self.first_step, self.last = warmup_steps * replicas, warmup_steps, False
        self.began = warmup_steps  # this replica's first averager step in the period (a healed one's: later)
        self.step_times: list[float | None] = [None] * replicas
        self.first_loss: float | None = None
        self.trained = [warmup_steps] * replicas  # local steps (warmup included) each replica trained
        self.loss: torch.Tensor | None = None  # the loop's loss of the step being taken
        self.initial: torch.Tensor | None = None  # the loss of this process's first step, until F0 is known
        self.started: float | None = None  # when this period's first local step began (None: not measured)
        self.met_s = 0.0  # of the time since: the levels' meetings within the period (hierarchical averaging)
        self.exchanges = 0  # exchanges since this process started
        self.row: dict = {}
        self.undo: tuple | None = None  # the plan before the last exchange, while it may not commit
        self.rejoined = False  # healed from a peer (fault tolerance): its step time restarts from its peers'
        self.exchanged = False  # this step was an exchange: every rank met at it
        self.carried: torch.Tensor | None = None  # the last exchange's `carried` figures, summed over every rank

    def observe(self, loss: torch.Tensor) -> None:
        """The loss of the step being taken (a device tensor: read at the next exchange, not now)."""
        self.loss = loss
        if self.first_loss is None and self.initial is None:
            self.initial = loss.detach().clone()

    def due(self, step: int) -> bool:
        """This replica exchanges after its averager step `step` (0-based)."""
        return not self.last and step == self.first_step + self.local_steps[self.replica] - 1

    def fragment(self) -> int:
        """The fragment the next exchange syncs (Streaming DiLoCo; 0 with one fragment)."""
        return self.syncs % self.fragments

    def global_step(self, steps_done: int) -> int:
        """The run's global step once this replica has taken `steps_done` averager steps."""
        if steps_done <= self.first_step:
            return steps_done if steps_done < self.first_step else self.start_done // self.replicas
        taken, mine, total = steps_done - self.first_step, self.local_steps[self.replica], sum(self.local_steps)
        done = self.start_done + total if taken >= mine else self.start_done + taken * total // mine
        return done // self.replicas

    def meeting_step(self, steps_done: int) -> int:
        """The global step every replica stands at when they meet, at the exchange that ends the period
        under way (each replica's own step there is interpolated, and differs): its start."""
        return steps_done if steps_done < self.first_step else self.start_done // self.replicas

    def slot(self, steps_done: int) -> int:
        """Where this replica's step after `steps_done` averager steps falls in the run's sequence of
        replica steps: in a period, the replicas' i-th steps follow each other in replica order, those
        that already took all theirs left out, so equal replicas read as `balance=steps` does."""
        if steps_done < self.first_step:
            return steps_done * self.replicas + self.replica
        taken = steps_done - self.first_step
        before = sum(min(k, taken) for k in self.local_steps)
        return self.start_done + before + sum(k > taken for k in self.local_steps[: self.replica])

    def done(self, steps_done: int) -> int:
        """Replica steps of the whole run at the meeting behind this replica's step after `steps_done`
        averager steps (once it has taken all of its period's, the one ahead): the same on every replica
        between two meetings, so a heal sends the position every replica holds."""
        if steps_done < self.first_step:
            return steps_done * self.replicas
        if steps_done - self.first_step >= self.local_steps[self.replica]:
            return self.start_done + sum(self.local_steps)
        return self.start_done

    def exchange(self, step: int, carried: torch.Tensor | None = None) -> list[int]:
        """At this replica's exchange after averager step `step`: share the figures (and `carried`, an
        averager's float64 figures to sum over every rank: `self.carried`), plan the next period.
        Returns each replica's local steps in the period that ends here (the average's weights)."""
        synchronize(self.device)  # the clock stops at finished work
        arrived = time.perf_counter()
        mine, r, n = step + 1 - self.began, self.replica, self.replicas  # the local steps it trained
        extra = 0 if carried is None else carried.numel()
        shared = torch.zeros(3 * n + 3 + extra, dtype=torch.float64, device=self.device)
        if carried is not None:
            shared[3 * n + 3 :] = carried
        if self.leads:  # one figure per replica; a step time of -1: restarted, take the peers' median
            if self.rejoined:
                shared[r] = -1.0
            elif self.started is not None:
                shared[r] = (arrived - self.started - self.met_s) / mine
            shared[n + r] = time.time()  # wall clock: comparable across ranks (to the hosts' sync)
            shared[2 * n + r] = mine
        if self.loss is not None:
            shared[3 * n] = self.loss.detach().to(torch.float64)
            shared[3 * n + 1] = 1.0
        if self.initial is not None:
            shared[3 * n + 2] = self.initial.to(torch.float64)
        dist.all_reduce(shared)  # every rank of the world is at this exchange
        if self.link is not None:
            self.link.sum_over_replicas(shared)  # and every replica group in the quorum (fault tolerance)
        self.carried = shared[3 * n + 3 :] if carried is not None else None
        figures = shared.tolist()
        self.undo = (self.period, list(self.local_steps), list(self.step_times), self.first_loss, list(self.trained))
        ranks = max(figures[3 * n + 1], 1.0)
        times, arrivals, loss = figures[:n], figures[n : 2 * n], figures[3 * n] / ranks
        # each replica's local steps since the last exchange; 0 for a group outside the quorum (fault tolerance)
        completed = [int(k) for k in figures[2 * n : 3 * n]]
        self.rejoined = False
        for q, t in enumerate(times):
            if t > 0:
                before = self.step_times[q]
                self.step_times[q] = t if before is None else SMOOTHING * t + (1 - SMOOTHING) * before
            elif t < 0:  # a group restarted and healed since the last exchange
                others = [x for p, x in enumerate(self.step_times) if p != q and x is not None]
                self.step_times[q] = statistics.median(others) if others else None
        self.trained = [a + k for a, k in zip(self.trained, completed)]
        latest = max(arrivals)
        self.row = {metrics.AVERAGER_PERIOD: self.period * self.fragments}
        for q in (q for q in range(n) if completed[q]):
            name = str(q)
            self.row[metrics.REPLICA_LOCAL_STEPS.named(name)] = completed[q]
            self.row[metrics.REPLICA_SAMPLES.named(name)] = self.trained[q] * self.samples_per_step
            self.row[metrics.REPLICA_WAIT.named(name)] = latest - arrivals[q]
            if times[q] > 0:
                self.row[metrics.REPLICA_STEP_TIME.named(name)] = times[q]
        if self.adapts:
            if self.first_loss is None:  # the run's first step's, where this process took it
                self.first_loss = figures[3 * n + 2] / ranks if self.initial is not None else loss
            self.initial = None
            self.period = adacomm_period(loss, self.first_loss, self.base_period, self.min_period)
        self.start_done += sum(self.local_steps)  # the period's data slots, a group outside it or not
        self.local_steps, self.last = fit_to_remaining(self.planned(), self.total - self.start_done)
        self.first_step = self.began = step + 1
        self.syncs, self.windows = self.syncs + 1, [*self.windows, completed][-self.fragments :]
        self.exchanged = True
        return completed

    def planned(self) -> list[int]:
        """Each replica's local steps in the period under way as planned at the exchange that began it
        (the run's last period: before it was cut to what remains)."""
        return balanced_local_steps(self.period, self.step_times) if self.balances else [self.period] * self.replicas

    def weights(self, completed: list[int]) -> float | None:
        """What this replica's tensors are scaled by before the mean over the replicas that trained
        (`completed` > 0), so that the mean is weighted by the local steps each trained since the
        synced tensors' last exchange (with fragments: the fragment's, its last F strides); None
        (the plain mean, bit for bit) when they are equal."""
        since = [sum(strides) for strides in zip(*self.windows)]
        return mean_weight([k for k, now in zip(since, completed) if now > 0], since[self.replica])

    def revert(self) -> None:
        """The exchange did not commit (fault tolerance: a group was lost in it), so nothing was averaged
        and the figures may be a part of the quorum's: the next period repeats the plan before it (the
        next exchange syncs the next fragment, as a dropped sync under `balance=steps` does)."""
        (self.period, local_steps, self.step_times, self.first_loss, self.trained), self.undo = self.undo, None
        self.local_steps, self.last = fit_to_remaining(local_steps, self.total - self.start_done)

    def after_exchange(self, traffic, committed: bool) -> None:
        """The averaging is over: its row gets the plan's figures (if it committed; else the plan
        is reverted), and the next period's local steps start now."""
        if committed:
            traffic.averaged = {**(traffic.averaged or {}), **self.row}
        else:
            self.revert()
        self.exchanges += 1

    def after_step(self) -> None:
        """The loop is done with a step. After an exchange, that includes its log, eval and save, which
        the step time leaves out: the next period's local steps start now (measured from the process's
        second exchange on: the period after its first holds its own start-up)."""
        if self.exchanged:
            self.exchanged = False
            self.started = time.perf_counter() if self.exchanges >= 2 else None
            self.met_s = 0.0

    def met(self, seconds: float) -> None:
        """A level's group met for `seconds` within the period (hierarchical averaging): the step time
        leaves it out, waits for a slower member included, so that a fast replica grouped with a slow
        one is planned by its own speed."""
        self.met_s += seconds

    def state_dict(self, steps_done: int) -> dict:
        """The plan, the same on every rank (positions relative to this replica's own step count)."""
        return {
            "period": self.period,
            "local_steps": list(self.local_steps),
            "start_done": self.start_done,
            "taken": steps_done - self.first_step,
            "last": self.last,
            "step_times": list(self.step_times),
            "first_loss": self.first_loss,
            "trained": list(self.trained),
            "syncs": self.syncs,
            "windows": [list(w) for w in self.windows],
            "replica": self.replica,
        }

    def plan_at(self, steps_done: int) -> dict:
        """The state of a run that took `period` local steps per replica and period up to
        `steps_done` averager steps (a checkpoint saved with `balance=steps`, `period_schedule=fixed`)."""
        first = self.first_step  # this averager's first exchange follows step first + local_steps - 1
        syncs, windows = 0, []
        if steps_done > first + self.local_steps[0] - 1:  # past the first exchange: the period under way
            exchanges = (steps_done - (first + self.local_steps[0])) // self.base_period
            syncs = 1 + exchanges
            windows = [list(self.local_steps), *[[self.base_period] * self.replicas] * min(exchanges, self.fragments)]
            first = first + self.local_steps[0] + exchanges * self.base_period
            plan, last = fit_to_remaining([self.base_period] * self.replicas, self.total - first * self.replicas)
        else:
            plan, last = list(self.local_steps), False
        return {
            "period": self.base_period,
            "local_steps": plan,
            "start_done": first * self.replicas,
            "taken": steps_done - first,
            "last": last,
            "step_times": [None] * self.replicas,
            "first_loss": None,
            "trained": [steps_done] * self.replicas,
            "syncs": syncs,
            "windows": windows[-self.fragments :],
        }

    def load_state_dict(self, state: dict, steps_done: int) -> None:
        """The plan of `state`, this replica `steps_done` averager steps in."""
        self.period, self.local_steps = state["period"], list(state["local_steps"])
        self.start_done, self.last = state["start_done"], state["last"]
        self.first_step = self.began = steps_done - state["taken"]
        self.step_times, self.first_loss = list(state["step_times"]), state["first_loss"]
        self.trained, self.started = list(state["trained"]), None
        self.syncs, self.windows = state["syncs"], [list(w) for w in state["windows"]]

    def join(self, sent: dict, steps_done: int) -> None:
        """Healed from a peer (fault tolerance) with its plan `sent`: sent at that peer's exchange, it puts
        this replica at that exchange too, at its own local step; its step time restarts from its peers'
        median, said at the exchange so that every replica restarts it alike."""
        if sent["taken"] == self.local_steps[sent["replica"]] - 1:
            self.first_step, self.began = steps_done - (self.local_steps[self.replica] - 1), steps_done
            self.rejoined = True


class PacedData:
    """The data positions of a rank whose replica steps at its own pace (`TokenStream.paced`)."""

    def __init__(self, averager, rank_in_replica: int, rank_samples: int, replica_samples: int):
        self.averager, self.rank_in_replica = averager, rank_in_replica
        self.rank_samples, self.replica_samples = rank_samples, replica_samples

    def first_sample(self, next_step: bool) -> int:
        """This rank's slice of the step being taken (or of the next: a guess, for reading ahead)."""
        slot = self.averager.pace.slot(self.averager.step + int(next_step))
        return slot * self.replica_samples + self.rank_in_replica * self.rank_samples

    def samples(self) -> int:
        return self.averager.pace.done(self.averager.step) * self.replica_samples
