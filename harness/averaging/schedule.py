"""When the averagers act: pure functions of the averager's step (the 0-based
iteration being taken) and the config's numbers, no process groups.

`synchronous` is the one warmup test: the gradient hook, the averagers'
schedules, DiLoCo's start of the outer copy and a checkpoint's choice of
replica copies all ask it (directly or through `diverged`).
"""

from __future__ import annotations


def synchronous(step: int, warmup_steps: int) -> bool:
    """Iteration `step` is a warmup step: gradients are averaged across replicas, parameters are not."""
    return step < warmup_steps


def last_synchronous(step: int, warmup_steps: int) -> bool:
    """Iteration `step` is the last warmup step: replicas train alone from the next one on."""
    return synchronous(step, warmup_steps) and not synchronous(step + 1, warmup_steps)


def diverged(steps_done: int, warmup_steps: int) -> bool:
    """After `steps_done` steps at least one was local, so the replicas' parameters
    and optimizer states may differ (a checkpoint keeps a copy per replica)."""
    return not synchronous(steps_done - 1, warmup_steps)


def periodic_due(step: int, warmup_steps: int, period: int) -> bool:
    """`PeriodicModelAverager`'s rule: average after iteration `warmup_steps + k·period`."""
    return not synchronous(step, warmup_steps) and (step - warmup_steps) % period == 0


def hierarchical_period(step: int, warmup_steps: int, periods) -> int | None:
    """`HierarchicalModelAverager`'s rule: past warmup, the largest of `periods`
    dividing `step` (its group averages), or None (no averaging)."""
    if synchronous(step, warmup_steps):
        return None
    return next((p for p in sorted(periods, reverse=True) if step % p == 0), None)


def fragment_due(step: int, warmup_steps: int, period: int, fragments: int) -> int | None:
    """(Streaming) DiLoCo, as the paper's Algorithm 1 and torchft's `DiLoCo` have
    it: the fragment that syncs after iteration `step`, or None. Past warmup a
    sync falls every `period / fragments` local steps, the fragments in turn, so
    fragment f first syncs after `(f + 1)·period/fragments` local steps and then
    every `period`: one fragment's outer step comes after `period` inner steps,
    the first one included (not after the first local step, as `periodic_due`'s)."""
    if synchronous(step, warmup_steps):
        return None
    stride = period // fragments
    local_steps = step - warmup_steps + 1
    return (local_steps // stride - 1) % fragments if local_steps % stride == 0 else None
