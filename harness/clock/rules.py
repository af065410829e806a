"""The plan's rules, pure functions of the figures every replica shares (no process group, no state):
how many local steps each replica takes between two exchanges, how the means are weighted, and where a
hierarchy's groups below all replicas meet (docs/configuration.md#uneven-replicas).

- `period_schedule=adacomm` (Wang & Joshi, SysML 2019): the period is ⌈√(F/F₀)·τ₀⌉, τ₀ = `averager.period`,
  F the ranks' mean training loss at the exchange that plans it, F₀ their mean loss at the run's first step
  (the paper's F(x₀)); never below `averager.min_period`, never above τ₀.
- `balance=time` (the dynamic local updates of Liu et al., arXiv 2401.09135): the fastest replica takes
  `period` local steps and each other as many as fit in the same time, from each replica's smoothed step
  time; a replica within `DEAD_BAND` of the fastest takes `period` too, so equal replicas train exactly what
  `balance=steps` trains. The average weighs each replica by the local steps its tensors hold.
"""

from __future__ import annotations

import math

DEAD_BAND = 0.25  # a replica up to 25 % slower than the fastest still takes `period` steps: timing noise
SMOOTHING = 0.5  # weight of the newest period in a replica's step time


def adacomm_period(loss: float, first_loss: float, period: int, min_period: int) -> int:
    """AdaComm's period for a training loss `loss` against the run's first step's `first_loss`."""
    if not (math.isfinite(loss) and math.isfinite(first_loss)) or first_loss <= 0 or loss < 0:
        return period
    return max(min_period, min(period, math.ceil(math.sqrt(loss / first_loss) * period)))


def auto_period(exchange_s: float | None, step_s: float | None, budget: float, shortest: int, longest: int) -> int:
    """`period=auto`'s local steps between two exchanges: the fewest that keep an exchange that holds training
    up for `exchange_s` within `budget` of the wall time, at `step_s` per local step; `shortest` until both are
    measured (a short period measures the link soonest), and within [`shortest`, `longest`]."""
    if exchange_s is None or step_s is None or step_s <= 0:
        return shortest
    steps = math.ceil(exchange_s * (1 - budget) / (budget * step_s) * (1 - 1e-12))  # ceil, not past a float's noise
    return max(shortest, min(longest, steps))


def exchange_share(exchange_s: float, step_s: float, steps: int) -> float:
    """The share of the wall time an exchange that holds training up for `exchange_s` takes, every `steps` local
    steps of `step_s` each."""
    return exchange_s / (steps * step_s + exchange_s) if exchange_s > 0 else 0.0


def balanced_local_steps(period: int, step_times: list[float | None]) -> list[int]:
    """Each replica's local steps for a period: the fastest takes `period`, the others as many as
    fit in its time (at least 1); `period` for all while a replica's time is unknown."""
    if any(t is None for t in step_times):
        return [period] * len(step_times)
    fastest = min(step_times)
    return [period if t <= fastest * (1 + DEAD_BAND) else max(1, round(period * fastest / t)) for t in step_times]


def smoothed(before: float | None, measured: float) -> float:
    """A replica's step time once a period measured `measured` (`before`: its time until then)."""
    return measured if before is None else SMOOTHING * measured + (1 - SMOOTHING) * before


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


def mean_weight(held: list[int], mine: int) -> float | None:
    """What a member whose tensors hold `mine` of the members' `held` local steps scales them by before
    their plain mean, so that the mean weighs each member by its steps; None (the plain mean, bit for
    bit) when they hold alike."""
    if len(set(held)) == 1:
        return None
    return mine * len(held) / sum(held)


def hierarchical_period(step: int, periods) -> int | None:
    """`HierarchicalModelAverager`'s rule for replicas that take the same steps: the largest of
    `periods` that divides the 0-based step `step` (its group averages after it), or None."""
    return next((p for p in sorted(periods, reverse=True) if step % p == 0), None)


def level_meeting(
    taken: int, planned: list[int], cut: list[int] | None, replica: int, sizes: dict[int, int], period: int
) -> tuple[int, list[int]] | None:
    """Hierarchical averaging's levels below all replicas, in a period whose replicas take different
    steps: the fastest replica's `period` local steps split at each multiple of the smallest level's
    period make m = period/smallest meeting points (the m-th: the exchange of all replicas), and a replica
    that takes k steps in the period, at an even speed, reaches the i-th after ⌊i·k/m⌋ of them. So the
    members of a group arrive together, and no group waits for another: the points come from the plan
    every replica holds. A point is held when each member of its level's group (`sizes`: period ->
    replicas per group, consecutive replicas) trained since the point before (a member still inside
    a step would stall the others) and, in the run's last period, cut to `cut`, trains on after it (a
    member's last step is a meeting of every rank, whose collectives come first: a group meeting there
    would wait for a partner waiting for every rank).

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
            reached(q, point) > reached(q, point - 1) and (cut is None or cut[q] > reached(q, point))
            for q in members(level(point))
        )

    point = math.ceil(taken * meetings / planned[replica])
    if point >= meetings or reached(replica, point) != taken or not held(point):
        return None
    p = level(point)
    last = next((j for j in range(point - 1, 0, -1) if level(j) >= p and held(j)), 0)
    return p, [reached(q, point) - reached(q, last) for q in members(p)]
