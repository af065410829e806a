"""The averagers' config rules (their `config_errors`, which `validate` asks
before any process group exists): why a config cannot build one, each
naming the key, its value and the fix. Pure: no process group, no file of
the run's."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from harness.components import target_class
from harness.config import PaceConf
from harness.models import build_model
from harness.optim import HARNESS_KEYS


def default_outer_lr() -> float:
    """DiLoCo's default outer learning rate, where it is stated: averager=diloco's default outer optimizer."""
    return OmegaConf.load(Path(__file__).parents[2] / "conf" / "averager" / "outer_optimizer" / "sgd.yaml").lr


def periodic_errors(cfg: DictConfig, replicas: int) -> list[str]:
    """Why `cfg` (the whole config) cannot average over `replicas` replicas every `averager.period` steps."""
    avg = cfg.averager
    return _period_errors(avg) + _warmup_errors(avg) + _comm_dtype_errors(avg) + pace_errors(cfg)


AUTO = "auto"


def is_auto(avg: DictConfig) -> bool:
    return str(avg.get("period")) == AUTO


def period_of(avg: DictConfig) -> tuple[str, int]:
    """The key and value the period rules and the averagers' schedules read: `averager.period`, or under
    `period=auto` `averager.max_period` (the longest it may take); (key, 0) where it is not a number
    (`_period_errors` says why)."""
    key = "max_period" if is_auto(avg) else "period"
    value = avg.get(key, 0)
    return f"averager.{key}", value if isinstance(value, int) and not isinstance(value, bool) else 0


def varies(avg: DictConfig) -> str | None:
    """The override that makes local steps vary between replicas or periods (the clock plans them), or None."""
    if str(avg.get("balance", "steps")) != "steps":
        return f"averager.balance={avg.balance}"
    if str(avg.get("period_schedule", "fixed")) != "fixed":
        return f"averager.period_schedule={avg.period_schedule}"
    if is_auto(avg):
        return "averager.period=auto"
    return None


def pace_errors(cfg: DictConfig) -> list[str]:
    """`averager.balance`, `averager.period_schedule`, `averager.min_period` and `period=auto`'s keys
    (harness/clock)."""
    avg, errors = cfg.averager, []
    key, period = period_of(avg)
    errors += _auto_errors(avg)
    if avg.get("min_period", 1) < 1:
        errors.append(
            f"averager.min_period={avg.min_period} is out of range: it must be >= 1. Fix: averager.min_period=1."
        )
    elif avg.get("min_period", 1) != 1 and str(avg.get("period_schedule", "fixed")) == "fixed" and not is_auto(avg):
        errors += _min_period_without_adacomm(avg)
    elif is_auto(avg) and period >= 1 and avg.get("min_period", 1) > period:
        errors.append(
            f"averager.min_period={avg.min_period} is above averager.max_period={period}: period=auto chooses "
            f"between them. Fix: averager.min_period between 1 and {period}, or averager.max_period="
            f"{avg.min_period} or more."
        )
    elif "period" in avg and period >= 1 and avg.get("min_period", 1) > period:
        errors.append(
            f"averager.min_period={avg.min_period} is above averager.period={avg.period}: the period starts at "
            f"averager.period and adacomm only shortens it. Fix: averager.min_period between 1 and {avg.period}, "
            f"or averager.period={avg.min_period} or more."
        )
    fragments = avg.get("fragments", 1)
    if str(avg.get("period_schedule", "fixed")) == "adacomm" and avg.get("period") == fragments:
        start = f"averager.period={avg.period}"
        if fragments > 1:
            start += f" and averager.fragments={fragments} (a fragment syncs after every local step)"
        errors.append(
            f"averager.period_schedule=adacomm with {start}: AdaComm starts at the period and shortens it (with "
            "fragments, in strides of period/fragments), and one local step between syncs cannot be shortened, "
            "so this would be a fixed period. Fix: a longer starting period (e.g. averager.period=32; AdaComm "
            "starts long), or averager.period_schedule=fixed."
        )
    delay, stride = avg.get("sync_delay", 0), period // max(fragments, 1)
    if str(avg.get("period_schedule", "fixed")) == "adacomm" and delay and 1 < stride <= delay + 1:
        errors.append(
            f"averager.period_schedule=adacomm with averager.sync_delay={delay}: AdaComm never shortens a stride "
            f"(period/fragments, here {stride}) to the delay or below (each sync is applied, and its fragment "
            "trains a step, before the next starts), so this would be a fixed period. Fix: a longer starting "
            f"period (averager.period={2 * (delay + 1) * max(fragments, 1)}), a shorter delay, or "
            "averager.period_schedule=fixed."
        )
    what = varies(avg)
    if what is None:
        return errors
    if "period_group_size" in avg:
        errors += _hierarchical_pace_errors(avg)
    if str(avg.get("balance", "steps")) == "time" and str(cfg.sharding.strategy) == "ddp":
        errors.append(
            "averager.balance=time with sharding=ddp: DDP's reducer all-reduces its used-parameter map over every "
            "rank at every step, so the replicas wait for each other at each step and none can take more. Fix: "
            "sharding=no_shard (the same layout, one replica per rank, without DDP)."
        )
    return errors


def _auto_errors(avg: DictConfig) -> list[str]:
    """`averager.period=auto` and its keys `comm_budget` and `max_period`, which nothing else reads."""
    errors, auto = [], is_auto(avg)
    if not auto:
        for key in ("comm_budget", "max_period"):
            default = PaceConf.__dataclass_fields__[key].default
            if key in avg and avg[key] != default:
                errors.append(
                    f"averager.{key}={avg[key]} without averager.period=auto has no effect: it bounds the period "
                    f"auto chooses, and averager.period={avg.get('period')} is fixed. Fix: averager.period=auto, or "
                    f"drop averager.{key}."
                )
        return errors
    if str(avg.get("period_schedule", "fixed")) != "fixed":
        errors.append(
            f"averager.period=auto with averager.period_schedule={avg.period_schedule}: each chooses the period "
            "(auto from what exchanges cost, AdaComm from the training loss), and a period has one owner. Fix: "
            "averager.period_schedule=fixed, or a number for averager.period (AdaComm shortens from it)."
        )
    budget = avg.get("comm_budget")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < 1:
        errors.append(
            f"averager.comm_budget={budget!r} is out of range: it is the share of wall time exchanges may hold "
            "training up, between 0 and 1 (0 would never exchange, 1 would exchange after every step at any "
            "cost). Fix: averager.comm_budget=0.1 (the default: at most a tenth of the time)."
        )
    most = avg.get("max_period")
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        errors.append(
            f"averager.max_period={most!r} is out of range: it is the longest period auto may choose, an integer "
            ">= 1. Fix: averager.max_period=64 (the default)."
        )
    return errors


def _min_period_without_adacomm(avg: DictConfig) -> list[str]:
    """`averager.min_period` bounds the period AdaComm chooses; with a fixed period it would change nothing."""
    if "period_group_size" in avg:  # hierarchical: no AdaComm (pace_errors refuses it)
        fix = "drop averager.min_period (averager=hierarchical averages at the fixed periods of period_group_size)"
    else:
        fix = (
            f"averager.period_schedule=adacomm to let the period shorten from averager.period={avg.period} down to "
            f"{avg.min_period}, or drop averager.min_period"
        )
    return [
        f"averager.min_period={avg.min_period} with averager.period_schedule=fixed has no effect: it is the "
        "shortest period AdaComm may choose, and a fixed schedule averages every averager.period steps "
        f"throughout. Fix: {fix}."
    ]


def _hierarchical_pace_errors(avg: DictConfig) -> list[str]:
    """The clock plans hierarchical averaging's largest period; the smaller levels meet at points of it."""
    errors = []
    if str(avg.get("period_schedule", "fixed")) != "fixed":
        errors.append(
            f"averager.period_schedule={avg.period_schedule} with averager=hierarchical: its levels average at "
            "several periods (averager.period_group_size), so there is no one period for AdaComm to shorten (not "
            "built). Fix: averager.period_schedule=fixed (averager.balance=time works), or averager=periodic."
        )
    periods = [pair[0] for pair in avg.period_group_size if len(pair) == 2]
    valid = all(isinstance(p, int) and p >= 1 for p in periods)  # else hierarchical_errors says why
    if str(avg.get("balance", "steps")) == "time" and valid and any(b % a for a, b in zip(periods, periods[1:])):
        pairs = [list(pair) for pair in avg.period_group_size]
        nested = [list(pairs[0])]
        for p, g in pairs[1:]:  # each period rounded up to a multiple of the one before
            nested.append([-(-p // nested[-1][0]) * nested[-1][0], g])
        key, fix = (f"averager.period_group_size={x}".replace(" ", "") for x in (pairs, nested))
        errors.append(
            f"averager.balance=time with {key}: each period must divide the next, since each replica's local "
            "steps of the largest period are split at the smaller periods' points, where its groups meet. "
            f"Fix: e.g. {fix}."
        )
    return errors


def hierarchical_errors(cfg: DictConfig, replicas: int) -> list[str]:
    whole, cfg = cfg, cfg.averager
    pairs = [list(pair) for pair in cfg.period_group_size]
    key = f"averager.period_group_size={pairs}".replace(" ", "")
    example = (
        f"averager.period_group_size=[[2,2],[8,{replicas}]]" if replicas > 2 else "averager.period_group_size=[[4,2]]"
    )
    if not pairs or any(len(pair) != 2 for pair in pairs):
        return [f"{key} must be a non-empty list of [period, group_size] pairs. Fix: e.g. {example}."]
    periods, sizes = [p for p, _ in pairs], [g for _, g in pairs]
    problems = []
    if any(p < 1 for p in periods) or periods != sorted(set(periods)):
        problems.append("periods (the first numbers) must be >= 1 and strictly increasing")
    if any(g < 1 or replicas % g for g in sizes):
        problems.append(f"every group size must divide the replica count {replicas}")
    elif any(b % a for a, b in zip(sizes, sizes[1:])):
        problems.append("each group size must divide the next (groups nest)")
    if sizes and sizes[-1] != replicas:
        problems.append(f"the largest period must average all {replicas} replicas (last group size = {replicas})")
    errors = [f"{key} is not a valid hierarchy: {'; '.join(problems)}. Fix: e.g. {example}."] if problems else []
    return errors + _warmup_errors(cfg) + _comm_dtype_errors(cfg) + pace_errors(whole)


def diloco_errors(cfg: DictConfig, replicas: int) -> list[str]:
    avg = cfg.averager
    errors = periodic_errors(cfg, replicas)
    outer = avg.outer_optimizer
    if outer is None:
        errors.append(
            "averager.outer_optimizer is not set. "
            "Fix: averager/outer_optimizer=sgd (the default), or nesterov (the paper's)."
        )
    else:
        errors += target_class(
            outer,
            "averager.outer_optimizer",
            torch.optim.Optimizer,
            "torch.optim.Optimizer",
            ("params",),
            "sgd|nesterov|adamw",
            HARNESS_KEYS,
        )[1]
        if outer.get("in_backward"):
            errors.append(
                "averager.outer_optimizer.in_backward=true: the outer optimizer steps at syncs, not in "
                "backward. Fix: averager.outer_optimizer.in_backward=false (optimizer.in_backward is the "
                "local optimizer's)."
            )
        lr = outer.get("lr")
        if not isinstance(lr, (int, float)) or lr <= 0:
            errors.append(
                f"averager.outer_optimizer.lr={lr!r} must be a positive number. "
                f"Fix: averager.outer_optimizer.lr={default_outer_lr()} (the default)."
            )
    errors += _overlap_errors(avg)
    f, (key, period) = avg.fragments, period_of(avg)
    if f < 1:
        errors.append(f"averager.fragments={f} is out of range: it must be >= 1. Fix: averager.fragments=1.")
    elif period >= 1 and period % f:
        divisors = [d for d in range(1, period + 1) if period % d == 0]
        errors.append(
            f"averager.fragments={f} does not divide {key}={period}: fragments sync at offsets "
            f"period/fragments apart. Fix: averager.fragments in {divisors}, or a period that is a multiple of {f}."
        )
    else:
        try:
            blocks = len(getattr(build_model(cfg.model, cfg.train.seq_len), "blocks", []))
        except ValueError:
            return errors  # the model's own error is reported by validate
        if f > max(blocks, 1):
            errors.append(
                f"averager.fragments={f} exceeds the model's {blocks} blocks; a fragment is whole blocks. "
                f"Fix: averager.fragments={max(d for d in range(1, max(blocks, 1) + 1) if period % d == 0)}."
            )
    return errors


def _overlap_errors(avg: DictConfig) -> list[str]:
    """`sync_delay` fits between two fragment syncs (one sync in flight at a time); `mix` is a weight."""
    errors, (key, period) = [], period_of(avg)
    interval = period // avg.fragments if avg.fragments >= 1 and period >= 1 else None
    if avg.sync_delay < 0 or (interval is not None and avg.sync_delay >= interval):
        most = max(interval - 1, 0) if interval is not None else 0
        errors.append(
            f"averager.sync_delay={avg.sync_delay} is out of range: a sync must be applied before the next "
            f"fragment's starts, {interval} local steps later ({key}={period} / "
            f"averager.fragments={avg.fragments}). Fix: averager.sync_delay between 0 and {most}, or a longer "
            "period per fragment."
        )
    if not 0.0 <= avg.mix <= 1.0:
        errors.append(
            f"averager.mix={avg.mix} is out of range: it weighs the locally trained parameters against the "
            "outer-updated ones. Fix: averager.mix in [0, 1] (0: DiLoCo's, the outer parameters)."
        )
    return errors


def _period_errors(cfg: DictConfig) -> list[str]:
    period = cfg.period
    if is_auto(cfg) or isinstance(period, int) and not isinstance(period, bool) and period >= 1:
        return []
    return [
        f"averager.period={period!r} is out of range: it must be an integer >= 1, or auto. Fix: averager.period=4 "
        "averages every 4 steps; averager.period=auto chooses each period from what exchanges cost."
    ]


def _warmup_errors(cfg: DictConfig) -> list[str]:
    if cfg.warmup_steps >= 0:
        return []
    return [
        f"averager.warmup_steps={cfg.warmup_steps} is out of range: it must be >= 0. "
        "Fix: averager.warmup_steps=0 starts local SGD at once."
    ]


def _comm_dtype_errors(cfg: DictConfig) -> list[str]:
    name = str(cfg.get("comm_dtype", "float32"))
    if hasattr(torch, name):
        return []
    return [
        f"averager.comm_dtype={name}: this torch build ({torch.__version__}) has no torch.{name}, so it cannot "
        "send in it. Fix: averager.comm_dtype=int8 (the same bytes), or a torch build with float8 types."
    ]
