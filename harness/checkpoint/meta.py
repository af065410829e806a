"""`meta.json`'s format: its version, the upgrade of every earlier version to today's, and the check of
each field's type and range (docs/checkpoints.md#which-checkpoints-load).

Versions (`format`; a file without it is 0 or 1, told apart by its `clock` part):

- 0: before the run's clock (2026-11-27 and earlier): the position is the step alone, of the saved config's
  fixed schedule (`cross_replica.averager_step`, a DiLoCo sync in flight's `apply_step`).
- 1: the clock's part (2026-11-28): its inputs. A run's last period, cut to `train.steps`, ended without an
  exchange, so its last checkpoint may hold replicas part-way through a period of different lengths.
- 2: a run's last step is an exchange (its last checkpoint holds one model); the version is written.
- 3: the clock's part holds the exchanges' measured time (`exchange_time`: `averager.period=auto`'s input).

`upgrade` turns any of them into today's before anything reads it, so the parts load today's format only;
`problems` checks today's: a file edited by hand, or written wrong, is refused before any rank starts,
naming the field, its value and what it must be. Pure: no process group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

FORMAT = 3  # the version this code writes
MODES = ("full", "sharded")


def version(meta: dict) -> int:
    """The format `meta` was written in."""
    if "format" in meta:
        return meta["format"]
    return 1 if "clock" in meta else 0


def upgrade(meta: dict) -> dict:
    """`meta` (already checked for the fields an upgrade reads: `problems(meta, upgrading=True)`) in today's
    format; an earlier version's state in today's terms."""
    meta = dict(meta)
    if version(meta) == 0:
        meta = _from_0(meta)
    if version(meta) == 1:
        meta = _from_1(meta)
    if version(meta) == 2:
        meta = _from_2(meta)
    return meta


def _from_0(meta: dict) -> dict:
    """Before the clock: its part from the saved config's fixed schedule up to `step` (every replica in step,
    measurements afresh); the averager's step and a sync in flight's apply step are the clock's now."""
    cross = dict(meta.get("cross_replica") or {})
    cross.pop("averager_step", None)
    if isinstance(cross.get("averager"), dict) and "in_flight" in cross["averager"]:
        averager = dict(cross["averager"])
        averager["in_flight"] = {"fragment": averager["in_flight"]["fragment"]}
        cross["averager"] = averager
    meta["cross_replica"] = cross
    meta.setdefault("lr_scheduler", {"last_epoch": meta["step"], "_step_count": meta["step"] + 1})
    meta["clock"] = _fixed_position(meta)
    return meta


def _fixed_position(meta: dict) -> dict:
    """The clock's inputs of a run that took its saved config's fixed periods up to its `step`."""
    from hydra.utils import get_class  # the averagers' classes say their schedules (torch: not at import)
    from omegaconf import OmegaConf

    from harness.clock import SYNCHRONOUS

    step, replicas = meta["step"], max(1, int((meta.get("mesh") or {}).get("replicate", 1)))
    averager = ((meta.get("config") or {}).get("averager")) or {}
    schedule = SYNCHRONOUS
    if averager.get("_target_") and replicas > 1:
        schedule = get_class(averager["_target_"]).schedule(OmegaConf.create(averager))
    warmup, first, stride = schedule.warmup, schedule.first, schedule.period // schedule.fragments
    syncs, start = 0, min(step, warmup)
    if step - warmup >= first:
        exchanges = (step - warmup - first) // stride
        syncs, start = 1 + exchanges, warmup + first + exchanges * stride
    return {
        "replicas": replicas,
        "done": start * replicas,
        "taken": [step - start] * replicas,
        "syncs": syncs,
        "trained": [start] * replicas,
        "held": [[0] * replicas for _ in range(schedule.fragments)],
        "step_times": [None] * replicas,
        "first_loss": None,
        "first_loss_shared": False,
        "exchange_loss": None,
    }


def _from_1(meta: dict) -> dict:
    """The clock's first format: a run's last checkpoint whose replicas had taken periods of different lengths
    (a cut last period, no exchange after it) counts them as taken (the next period starts at the checkpoint:
    its exchange weighs each replica by the steps its tensors hold, these included); a non-finite F₀ (a
    skipped first step) is asked for again."""
    clock = dict(meta["clock"])
    taken = clock["taken"]
    if len(set(taken)) > 1:
        clock["done"] += sum(taken)
        clock["trained"] = [a + k for a, k in zip(clock["trained"], taken)]
        clock["held"] = [[h + k for h, k in zip(held, taken)] for held in clock["held"]]
        clock["taken"] = [0] * len(taken)
    if clock.get("first_loss") is not None and not math.isfinite(clock["first_loss"]):
        clock["first_loss"] = None
    return {**meta, "clock": clock, "format": 2}


def _from_2(meta: dict) -> dict:
    """No exchange was measured yet: `averager.period=auto` measures from the resumed run's exchanges."""
    return {**meta, "clock": {**meta["clock"], "exchange_time": None}, "format": FORMAT}


# -- the check --------------------------------------------------------------------------------------


class Field:
    """A field's rule: `ok(value)` and what it must be, in words."""

    def __init__(self, ok: Callable[[Any], bool], must: str):
        self.ok, self.must = ok, must


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


NONNEG = Field(lambda v: _int(v) and v >= 0, "an integer >= 0")
POSITIVE = Field(lambda v: _int(v) and v >= 1, "an integer >= 1")
INTEGER = Field(_int, "an integer")
NUMBER = Field(_number, "a finite number")
NUMBER_OR_NULL = Field(lambda v: v is None or _number(v), "a finite number or null")
TIME_OR_NULL = Field(lambda v: v is None or _number(v) and v > 0, "a positive number of seconds or null")
BOOL = Field(lambda v: isinstance(v, bool), "true or false")
TEXT = Field(lambda v: isinstance(v, str), "a string")
DICT = Field(lambda v: isinstance(v, dict), "an object")
LIST = Field(lambda v: isinstance(v, list), "a list")

# what an upgrade reads, in every version
HEAD = {"step": NONNEG, "mode": Field(lambda v: v in MODES, f"one of {', '.join(MODES)}"), "world_size": POSITIVE}
HEAD |= {"replica_copies": POSITIVE, "mesh": DICT, "model": DICT, "optimizer": TEXT}
OPTIONAL = {"config": DICT, "tensor_parts": LIST, "torch": TEXT, "bytes": NONNEG, "cross_replica": DICT}
OPTIONAL |= {"data": DICT, "lr_scheduler": DICT}
CLOCK = {"replicas": POSITIVE, "done": NONNEG, "taken": LIST, "syncs": NONNEG, "trained": LIST, "held": LIST}
CLOCK |= {"step_times": LIST, "first_loss": NUMBER_OR_NULL, "first_loss_shared": BOOL}
CLOCK |= {
    "exchange_loss": NUMBER_OR_NULL,
    "exchange_time": Field(lambda v: v is None or _number(v) and v >= 0, "a number of seconds >= 0, or null"),
}
LR_SCHEDULER = {"last_epoch": INTEGER, "_step_count": NONNEG, "_last_lr": LIST, "base_lrs": LIST}


def problems(meta: Any, upgrading: bool = False) -> list[str]:
    """Why `meta` (a meta.json's content, in today's format; `upgrading`: of any version, the fields an
    upgrade reads alone, its clock part among them where it has one) cannot be a checkpoint's: each names
    the field, its value and what it must be."""
    if not isinstance(meta, dict):
        return [f"it holds {type(meta).__name__}, not an object"]
    found = []
    if "format" in meta and not (_int(meta["format"]) and 0 <= meta["format"] <= FORMAT):
        found.append(_bad("format", meta["format"], f"an integer from 0 to {FORMAT} (this code's)"))
    found += _fields(meta, HEAD, "", required=True) + _fields(meta, OPTIONAL, "", required=False)
    if found or upgrading and "clock" not in meta:
        return found
    found += _clock_problems(meta)  # an upgrade of a version that has the part reads it too
    if found or upgrading:
        return found
    data = meta.get("data", {})
    found += _fields(data, {"samples": NONNEG}, "data.", required=False) if isinstance(data, dict) else []
    lr = meta.get("lr_scheduler", {})
    found += _fields(lr, LR_SCHEDULER, "lr_scheduler.", required=False) if isinstance(lr, dict) else []
    for key in ("_last_lr", "base_lrs"):
        found += _items(lr.get(key) if isinstance(lr, dict) else None, NUMBER, f"lr_scheduler.{key}")
    found += _cross_replica_problems(meta.get("cross_replica", {}))
    return found


def _bad(field: str, value, must: str) -> str:
    return f"{field} is {_shown(value)}, but must be {must}"


def _shown(value) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 60 else text[:57] + "..."


def _fields(node: dict, rules: dict[str, Field], prefix: str, required: bool) -> list[str]:
    found = []
    for key, rule in rules.items():
        if key not in node:
            if required:
                found.append(f"{prefix}{key} is missing (it must be {rule.must})")
        elif not rule.ok(node[key]):
            found.append(_bad(f"{prefix}{key}", node[key], rule.must))
    return found


def _items(values, rule: Field, field: str, length: int | None = None) -> list[str]:
    """Each item of the list `values` (skipped when not a list: its own rule says so) follows `rule`; with
    `length`, there are that many."""
    if not isinstance(values, list):
        return []
    if length is not None and len(values) != length:
        return [f"{field} has {len(values)} items, but must have {length} (one per replica)"]
    return [_bad(f"{field}[{i}]", v, rule.must) for i, v in enumerate(values) if not rule.ok(v)]


def _clock_problems(meta: dict) -> list[str]:
    clock = meta.get("clock")
    if not isinstance(clock, dict):
        return [_bad("clock", clock, "an object (the clock part: where the run stands)")]
    since = {"exchange_time": 3}  # a field's first version: an earlier one's clock part has not got it
    fields = {key: rule for key, rule in CLOCK.items() if version(meta) >= since.get(key, 0)}
    found = _fields(clock, fields, "clock.", required=True)
    n = clock.get("replicas") if POSITIVE.ok(clock.get("replicas")) else None
    found += _items(clock.get("taken"), NONNEG, "clock.taken", n)
    found += _items(clock.get("trained"), NONNEG, "clock.trained", n)
    found += _items(clock.get("step_times"), TIME_OR_NULL, "clock.step_times", n)
    for f, held in enumerate(clock.get("held") if isinstance(clock.get("held"), list) else []):
        found += [_bad(f"clock.held[{f}]", held, "a list")] if not isinstance(held, list) else []
        found += _items(held, INTEGER, f"clock.held[{f}]", n)
    if found:
        return found
    step, done, taken = meta["step"], clock["done"], clock["taken"]
    if not done // n <= step <= (done + sum(taken)) // n:
        found.append(
            f"clock.done={done} and clock.taken={taken} over {n} replicas put the run at step {done // n} to "
            f"{(done + sum(taken)) // n}, but its step is {step}: the clock and the step disagree"
        )
    return found


def _cross_replica_problems(cross) -> list[str]:
    if not isinstance(cross, dict):
        return []
    found = _fields(cross, {"cross_replica_bytes_total": NONNEG, "averager": DICT, "replica_link": DICT}, "", False)
    found = [f"cross_replica.{p}" for p in found]
    averager = cross.get("averager")
    if found or not isinstance(averager, dict):
        return found
    fragments = averager.get("fragments")
    if "fragments" in averager and not (
        isinstance(fragments, list) and all(isinstance(f, list) and all(map(TEXT.ok, f)) for f in fragments)
    ):
        found.append(_bad("cross_replica.averager.fragments", fragments, "a list of lists of parameter names"))
    if "outer_state" in averager and not (
        isinstance(averager["outer_state"], list) and all(map(TEXT.ok, averager["outer_state"]))
    ):
        found.append(_bad("cross_replica.averager.outer_state", averager["outer_state"], "a list of parameter names"))
    in_flight = averager.get("in_flight")
    if in_flight is not None:
        count = len(fragments) if isinstance(fragments, list) else 0
        fragment = in_flight.get("fragment") if isinstance(in_flight, dict) else None
        if not (_int(fragment) and 0 <= fragment < count):
            found.append(
                _bad("cross_replica.averager.in_flight.fragment", fragment, f"one of the {count} fragments' numbers")
            )
    return found
