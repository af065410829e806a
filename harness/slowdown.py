"""A test-only knob, never a config key: replicas made slower, to measure
`averager.balance=time` on a machine whose replicas are equally fast.

`HARNESS_TEST_SLOWDOWN="1:2"` (replica:factor, comma-separated) makes each rank
of replica 1 sleep, every local step, for (factor − 1) × the time its own
forward, backward and clipping took (a synchronous step's backward holds the
gradient exchange, which a slower device would not stretch): a device `factor` times slower, simulated.
`HARNESS_TEST_SLOWDOWN="0:0.1s,1:0.1s"` (seconds) pads each of those to 0.1 s
instead: devices of one fixed speed, which the load of a shared host cannot
tell apart (a test's equal replicas). The tests and `bench/uneven.py` set it; a
user never needs to.
"""

from __future__ import annotations

import os
import time

import torch

from harness.dist import synchronize

ENV = "HARNESS_TEST_SLOWDOWN"


class Slowdown:
    """At each `after_compute`, sleeps `(factor - 1)` × the compute time since `begin()`, or until
    it is `seconds` long."""

    def __init__(self, factor: float | None = None, seconds: float | None = None):
        self.factor, self.seconds, self.started = factor, seconds, time.perf_counter()

    def begin(self) -> None:
        self.started = time.perf_counter()

    def after_compute(self, device: torch.device) -> None:
        synchronize(device)
        took = time.perf_counter() - self.started
        time.sleep((self.factor - 1) * took if self.factor is not None else max(0.0, self.seconds - took))


def slowdown_for(replica: int) -> Slowdown | None:
    """This replica's slowdown from `HARNESS_TEST_SLOWDOWN`, or None."""
    spec = os.environ.get(ENV, "").strip()
    slowdowns = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        which, _, value = item.partition(":")
        try:
            seconds = value.endswith("s")
            number = float(value.removesuffix("s"))
            slowdowns[int(which)] = Slowdown(seconds=number) if seconds else Slowdown(factor=number)
        except ValueError:
            raise ValueError(
                f"{ENV}={spec!r}: each item must be replica:factor or replica:<seconds>s, e.g. {ENV}=1:2"
            ) from None
    slowdown = slowdowns.get(replica)
    if slowdown is None or (slowdown.factor is not None and slowdown.factor <= 1):
        return None
    return slowdown
