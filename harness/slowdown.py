"""A test-only knob, never a config key: replicas made slower, to measure
`averager.balance=time` on a machine whose replicas are equally fast.

`HARNESS_TEST_SLOWDOWN="1:2"` (replica:factor, comma-separated) makes each rank
of replica 1 sleep, every step, for (factor − 1) × the time its own forward,
backward and clipping took: a device `factor` times slower, simulated. The tests
and `bench/uneven.py` set it; a user never needs to.
"""

from __future__ import annotations

import os
import time

import torch

from harness.dist import synchronize

ENV = "HARNESS_TEST_SLOWDOWN"


class Slowdown:
    """Sleeps `(factor - 1)` × the compute time since `begin()` at each `after_compute`."""

    def __init__(self, factor: float):
        self.factor, self.started = factor, time.perf_counter()

    def begin(self) -> None:
        self.started = time.perf_counter()

    def after_compute(self, device: torch.device) -> None:
        synchronize(device)
        time.sleep((self.factor - 1) * (time.perf_counter() - self.started))


def slowdown_for(replica: int) -> Slowdown | None:
    """This replica's slowdown from `HARNESS_TEST_SLOWDOWN`, or None."""
    spec = os.environ.get(ENV, "").strip()
    factors = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        which, _, factor = item.partition(":")
        try:
            factors[int(which)] = float(factor)
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: each item must be replica:factor, e.g. {ENV}=1:2") from None
    factor = factors.get(replica)
    return Slowdown(factor) if factor is not None and factor > 1 else None
