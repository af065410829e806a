"""Learning-rate schedules for the local optimizer (`lr_scheduler` group).

A schedule is a `torch.optim.lr_scheduler.LRScheduler` class named by
`lr_scheduler._target_`, built with the local optimizer and, when it accepts
one, `total_steps` (`train.steps`): `constant`, `warmup_cosine` and `wsd` are
the harness's (LambdaLR factors of `optimizer.lr`, as torchtitan's), `step` is
torch's `MultiStepLR`; any other torch scheduler is one YAML file away.

It is stepped once per optimizer step, after the step, so step s (1-based)
trains at `lr × factor(s − 1)`. With `optimizer.in_backward` each
per-parameter optimizer gets its own scheduler on the same schedule. DiLoCo's
outer optimizer is not scheduled. The position is a checkpoint part
(`LRSchedule`); what else a scheduler holds is given by the config.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from harness.optim import StepInBackward


class Constant(LambdaLR):
    """`optimizer.lr` throughout."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer, lambda step: 1.0)


class WarmupCosine(LambdaLR):
    """Linear warmup over `warmup_steps` (from lr/warmup_steps up to lr), then
    cosine decay to `min_lr_ratio × lr` at the last step."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float):
        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = (step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

        super().__init__(optimizer, factor)


class WarmupStableDecay(LambdaLR):
    """Warmup–stable–decay: linear warmup over `warmup_steps`, `lr` until the
    last `decay_fraction` of the run, then a linear decay to `min_lr_ratio × lr`
    at the last step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int,
        decay_fraction: float,
        min_lr_ratio: float,
    ):
        decay_steps = max(round(decay_fraction * total_steps), 1)
        decay_start = total_steps - decay_steps

        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            if step < decay_start:
                return 1.0
            progress = (step + 1 - decay_start) / decay_steps
            return 1.0 - (1.0 - min_lr_ratio) * min(progress, 1.0)

        super().__init__(optimizer, factor)


# what a scheduler's state holds beyond the config: its position, the lr it reached and the rates it started from
POSITION_KEYS = ("last_epoch", "_step_count", "_last_lr", "base_lrs")


class LRSchedule:
    """The local optimizer's schedule: one scheduler, or one per parameter's
    optimizer (`optimizer.in_backward`), all on the same schedule. A checkpoint
    part: its position goes into meta.json; the learning rates themselves are
    in the optimizer's state."""

    def __init__(self, schedulers: list[LRScheduler]):
        self.schedulers = schedulers

    def step(self) -> None:
        """After every step, skipped ones included (the rate is a function of the step), so without a
        preceding optimizer step now and then: torch's warning about that order is not for this loop."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before", UserWarning)
            for scheduler in self.schedulers:
                scheduler.step()

    @property
    def lr(self) -> float:
        """The learning rate the next step trains at."""
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict:
        state = self.schedulers[0].state_dict()
        return {key: state[key] for key in POSITION_KEYS if key in state}

    def load_state_dict(self, state: dict) -> None:
        """The saved position. The rates come from the run's `optimizer.lr` (the schedulers' base rates, as
        built): where it is the saved one, the saved rates, bit for bit; else the schedule's rates of the new
        one at that position, set into the optimizer's param groups, whose saved rates the load put there (a
        checkpoint saved before schedules existed is at position `step`: harness/checkpoint/meta.py)."""
        position = {key: state[key] for key in ("last_epoch", "_step_count") if key in state}
        for scheduler in self.schedulers:
            scheduler.__dict__.update(position)
            if state.get("base_lrs") == scheduler.base_lrs and "_last_lr" in state:
                rates = list(state["_last_lr"])
            else:
                with warnings.catch_warnings():  # torch warns of get_lr outside step(): the closed form is wanted
                    warnings.filterwarnings("ignore", "To get the last learning rate computed", UserWarning)
                    rates = getattr(scheduler, "_get_closed_form_lr", scheduler.get_lr)()
            scheduler._last_lr = rates
            for group, rate in zip(scheduler.optimizer.param_groups, rates):
                group["lr"] = rate


def depends_on_total_steps(cfg: DictConfig) -> bool:
    """The schedule `cfg` (= cfg.lr_scheduler) is a function of the run's length (`train.steps`)."""
    return "total_steps" in inspect.signature(instantiate(cfg, _partial_=True).func).parameters


def build_lr_schedule(cfg: DictConfig, optimizer, total_steps: int) -> LRSchedule:
    """The schedule `cfg` (= cfg.lr_scheduler) names over the local optimizer (before any averaging wrapper)."""
    build = instantiate(cfg, _partial_=True)
    extra = {"total_steps": total_steps} if depends_on_total_steps(cfg) else {}
    optimizers = optimizer.optimizers if isinstance(optimizer, StepInBackward) else [optimizer]
    return LRSchedule([build(optimizer=o, **extra) for o in optimizers])


def config_errors(cfg: DictConfig) -> list[str]:
    """The schedule's rules against the run: warmup, minimum and milestones (checked by `validate`)."""
    sched, steps = cfg.lr_scheduler, cfg.train.steps
    name = OmegaConf.select(cfg, "lr_scheduler._target_")
    errors = []
    warmup = sched.get("warmup_steps")
    if warmup is not None and not 1 <= warmup <= steps:
        errors.append(
            f"lr_scheduler.warmup_steps={warmup} must be in [1, train.steps={steps}]: the warmup ramps the learning "
            f"rate up over that many steps of the run. Fix: lr_scheduler.warmup_steps={max(1, steps // 10)}."
        )
    ratio = sched.get("min_lr_ratio")
    if ratio is not None and not 0 <= ratio <= 1:
        errors.append(
            f"lr_scheduler.min_lr_ratio={ratio} puts the minimum learning rate "
            f"{'above the peak (optimizer.lr)' if ratio > 1 else 'below zero'}: it is a fraction of optimizer.lr. "
            "Fix: lr_scheduler.min_lr_ratio=0.1."
        )
    fraction = sched.get("decay_fraction")
    if fraction is not None and not 0 < fraction <= 1:
        errors.append(
            f"lr_scheduler.decay_fraction={fraction} must be in (0, 1]: the share of the run spent decaying. "
            "Fix: lr_scheduler.decay_fraction=0.2."
        )
    elif fraction is not None and warmup is not None and warmup > steps - max(round(fraction * steps), 1):
        errors.append(
            f"lr_scheduler.warmup_steps={warmup} runs into the decay, which starts at step "
            f"{steps - max(round(fraction * steps), 1)} of train.steps={steps} (lr_scheduler.decay_fraction="
            f"{fraction}). Fix: a shorter warmup or a smaller decay_fraction."
        )
    milestones = sched.get("milestones")
    if milestones is not None:
        values = list(milestones)
        if not values or values != sorted(set(values)) or values[0] < 1 or values[-1] > steps:
            errors.append(
                f"lr_scheduler.milestones={values} must be strictly increasing steps in [1, train.steps={steps}] "
                f"({name} decays the learning rate after each). Fix: e.g. "
                f"lr_scheduler.milestones=[{steps // 2},{3 * steps // 4}]."
            )
    return errors
