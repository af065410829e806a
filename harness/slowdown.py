"""Test-only knobs, never config keys: replicas made slower, to measure
`averager.balance=time` on a machine whose replicas are equally fast, and a
slower link, to watch `averager.period=auto` follow it.

`HARNESS_TEST_SLOWDOWN="1:2"` (replica:factor, comma-separated) makes each rank
of replica 1 sleep, every local step, for (factor − 1) × the time its own
forward, backward and clipping took (a synchronous step's backward holds the
gradient exchange, which a slower device would not stretch): a device `factor` times slower, simulated.
`HARNESS_TEST_SLOWDOWN="0:0.1s,1:0.1s"` (seconds) pads each of those to 0.1 s
instead: devices of one fixed speed, which the load of a shared host cannot
tell apart (a test's equal replicas). The tests and `bench/uneven.py` set it; a
user never needs to.

`HARNESS_TEST_EXCHANGE_DELAY=0.2` (seconds) makes every rank sleep 0.2 s at each
exchange of all replicas, after the figures every replica sends and before the
exchange's collectives: a link that much slower, simulated.
"""

from __future__ import annotations

import math
import os
import time

import torch

from harness.dist import synchronize

ENV = "HARNESS_TEST_SLOWDOWN"
# a slower link: every rank sleeps this many seconds at each exchange of all replicas, inside the time the exchange
# holds training up (as a link that slow would: what `averager.period=auto` measures)
EXCHANGE_DELAY_ENV = "HARNESS_TEST_EXCHANGE_DELAY"


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


FORMAT = "<replica>:<factor> or <replica>:<seconds>s, comma-separated"


def slowdowns(spec: str) -> dict[int, Slowdown]:
    """The slowdowns `spec` (a `HARNESS_TEST_SLOWDOWN` value) asks for, by replica; ValueError says why it is
    not one (a factor below 1 would not slow a replica, and a negative, NaN or infinite time cannot be slept)."""
    found: dict[int, Slowdown] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        which, colon, value = item.partition(":")
        seconds = value.endswith("s")
        try:
            replica, number = int(which), float(value.removesuffix("s"))
        except ValueError:
            replica = number = None
        if not colon or replica is None or replica < 0:
            problem = f"{item!r} is not of that form (a replica is an integer >= 0)"
        elif not math.isfinite(number) or number < (0 if seconds else 1):
            what = "seconds must be a finite number >= 0" if seconds else "a factor must be a finite number >= 1"
            problem = f"in {item!r} {what}"
        elif replica in found:
            problem = f"replica {replica} is named twice"
        else:
            found[replica] = Slowdown(seconds=number) if seconds else Slowdown(factor=number)
            continue
        raise ValueError(problem)
    return found


def config_errors(replicas: int, local_steps: bool = True) -> list[str]:
    """`HARNESS_TEST_SLOWDOWN` checked before any rank starts, as a setting is (`validate`): a malformed value,
    one that names a replica the run does not have, or any in a run without local steps (`local_steps` false:
    synchronous training, whose steps it leaves alone): it would slow nothing."""
    spec = os.environ.get(ENV, "")
    try:
        unknown = sorted(set(slowdowns(spec)) - set(range(replicas)))
        if unknown:
            problem = (
                f"the run has {replicas} replica(s), 0..{replicas - 1}, so replica {unknown[0]} would slow nothing"
            )
        elif slowdowns(spec) and not local_steps:
            return [
                f"{ENV}={spec!r} (a test knob that slows replicas, harness/slowdown.py) slows local steps only (a "
                "synchronous step's backward holds the gradient exchange, which a slower device would not stretch), "
                f"and this run trains synchronously (averager=none): it would slow nothing. Fix: unset {ENV}, or "
                "an averager (averager=periodic) for local steps to slow."
            ]
        else:
            return []
    except ValueError as e:
        problem = str(e)
    return [
        f"{ENV}={spec!r} (a test knob that slows replicas, harness/slowdown.py) takes {FORMAT}: {problem}. Fix: "
        f"e.g. {ENV}=1:2 (replica 1 twice as slow) or {ENV}=0:0.1s,1:0.2s (each local step's compute padded to "
        f"that time), or unset {ENV}."
    ]


def slowdown_for(replica: int) -> Slowdown | None:
    """This replica's slowdown from `HARNESS_TEST_SLOWDOWN` (checked by `config_errors`), or None."""
    slowdown = slowdowns(os.environ.get(ENV, "")).get(replica)
    if slowdown is None or (slowdown.factor is not None and slowdown.factor == 1):
        return None
    return slowdown


def exchange_delay_errors(averages: bool) -> list[str]:
    """`HARNESS_TEST_EXCHANGE_DELAY` checked before any rank starts: seconds, a finite number >= 0, in a run with
    exchanges (`averages`: an averager over several replicas)."""
    value = os.environ.get(EXCHANGE_DELAY_ENV)
    if value is None:
        return []
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    knob = f"{EXCHANGE_DELAY_ENV}={value!r} (a test knob that slows each exchange, harness/slowdown.py)"
    if not math.isfinite(seconds) or seconds < 0:
        return [f"{knob} takes seconds, a finite number >= 0. Fix: e.g. {EXCHANGE_DELAY_ENV}=0.2, or unset it."]
    if not averages:
        return [
            f"{knob} delays exchanges of all replicas, and this run has none (no averager, or one replica). Fix: "
            f"unset {EXCHANGE_DELAY_ENV}, or an averager over several replicas (averager=periodic)."
        ]
    return []


def exchange_delay_s() -> float:
    """Each exchange's delay from `HARNESS_TEST_EXCHANGE_DELAY` (checked by `exchange_delay_errors`), or 0."""
    return float(os.environ.get(EXCHANGE_DELAY_ENV, 0))
