"""`train.nonfinite`: what a step whose loss or gradients are NaN/inf does,
decided without reading the device every step.

A fused optimizer (`optimizer.fused`, the default on CUDA) skips its whole
update, moments and step count included, when its `found_inf` tensor is 1:
the flag `torch.amp.GradScaler` sets for it. So each step costs a few device
ops: the flag is the gradient norm's finiteness, which is the same on every
rank of a replica (the norm is reduced over the replica's shards). It covers
the loss: backward starts from `loss·0 + 1` instead of 1 (`backward`), so a
NaN/inf loss makes every gradient NaN, even an infinite loss whose gradients
would be finite (a target whose logit is -inf), and the gradient reduction
carries that to every rank that shares the gradients. A replica that skips a
local step alone is fine: it still takes part in every collective.

A skipped step leaves the optimizer's state as it was, bit for bit. Where a
fused step is the optimizer's first, it creates the state it then skips
writing (fused SGD's momentum comes from `empty_like`), so that one step reads
its flag back on the host and, if it was skipped, forgets the state it
created: the next step is a first step again, as in a run that never saw the
bad batch.

The host reads what happened only where it waits anyway: on steps where every
rank meets (the clock's meetings: every step when the replicas take the same
steps; with `averager.balance=time` an exchange, a synchronous step, the last
step) that log, evaluate, save or average, and at least every
`MAX_UNREPORTED` steps. Each rank keeps one flag per step it took since the
last report (the buffer grows where a replica takes more, so no flag is
overwritten before it is read); a report agrees over every rank whether any
step was bad (one all-reduce of each rank's first bad step), so a NaN anywhere
stops every rank under `error`, each naming the step it counts as its own,
and nothing stops a run that had none. `skip` logs there how many steps were
skipped; `error` stops there, at most `train.log_every - 1` steps (with
`balance=time`, a period) after the bad one. Either way no non-finite value was
ever applied, so none is saved or averaged (a save also refuses non-finite
state).

Optimizers without `found_inf` (not fused, or `optimizer.in_backward`, whose
steps ran in backward) are checked on the host every step, agreed by the ranks
that took the step together (every rank at a meeting; else the replica's), so
every rank that shares the gradients takes the same branch: one 1-element
all-reduce and one host sync per step. `error` stops at once where every rank
meets; elsewhere at the next report, the step skipped meanwhile (with
`optimizer.in_backward` at once: its update ran in backward, and must not be
averaged or saved).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from harness import metrics
from harness.clock import Tick
from harness.dist import true_on_every_rank

log = logging.getLogger(__name__)

MAX_UNREPORTED = 1000  # steps between two reads of the device's flags, at most, where the ranks meet


class NonFiniteLossError(RuntimeError):
    """The loss or gradients became NaN/inf; the message names the step and the fix."""


class NonFiniteGuard:
    """`train.nonfinite` for the loop: `check` every step, `report` where every rank meets and the host waits."""

    def __init__(
        self,
        policy: str,
        optimizer,
        device: torch.device,
        log_every: int,
        steps_in_backward: bool,
        replica_ranks: dist.ProcessGroup | None,
    ):
        """`replica_ranks`: the ranks that share this rank's gradients (its replica), which agree on a step
        where not every rank meets."""
        self.policy, self.steps_in_backward, self.replica_ranks = policy, steps_in_backward, replica_ranks
        # the fused optimizers read `found_inf` (GradScaler's protocol); in backward the step has already run
        self.on_device = getattr(optimizer, "_step_supports_amp_scaling", False) and not steps_in_backward
        self.optimizer, self.device = optimizer, device
        self.steps: list[int] = []  # the global step of each step checked since the last report
        self.reported = 0  # the step of the last report
        self.bad_on_host: list[int] = []  # steps the host's check skipped since the last report
        if self.on_device:
            self.flags = torch.zeros(min(max(log_every, 1), MAX_UNREPORTED), device=device)  # one per step since
            optimizer.register_step_pre_hook(self._before_step)
            optimizer.register_step_post_hook(self._after_step)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`; on the device, from `loss·0 + 1` (1 for a finite loss, NaN otherwise), so that
        a non-finite loss makes every gradient NaN, which the gradient norm's check sees on every rank
        that shares the gradients. The host's check reads the loss itself."""
        loss.backward(loss.detach() * 0 + 1 if self.on_device else None)

    def check(self, tick: Tick, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Whether the optimizer may step. On the device: always (a non-finite step is skipped there);
        on the host: the step's check, agreed by the ranks that took it together, raising for `error`
        (where every rank meets, or in backward; else at the next report) and logging for `skip`."""
        if self.on_device:
            if len(self.steps) == len(self.flags):  # a longer stretch than ever: room for it, nothing dropped
                self.flags = torch.cat([self.flags, torch.zeros_like(self.flags)])
            flag = self.flags[len(self.steps)]
            self.steps.append(tick.step)
            # 0·x is 0 for a finite x and NaN for NaN and ±inf: not finite in two ops (isfinite is four, + a not)
            torch.ne(grad_norm * 0, 0, out=flag)
            self.optimizer.found_inf = flag
            return True
        finite = torch.isfinite(loss.detach()).all()
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm)
        if true_on_every_rank(finite, None if tick.meeting else self.replica_ranks):
            return True
        if self.policy == "error" and not (tick.meeting or self.steps_in_backward):
            self.bad_on_host.append(tick.step)  # the other replicas hear of it at the next report
        else:
            self._handle(tick.step, [tick.step], None)
        return False

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.states_before = len(optimizer.state)

    def _after_step(self, optimizer, args, kwargs) -> None:
        """A step that created optimizer state (a first step) and was skipped created it without writing
        it: forget it, so the next step is a first step again. Read on the host, once: every later step
        finds the state there. (A step before the loop's first, such as the one DCP takes with zero gradients
        to create the state a resume loads into, has no flag yet.)"""
        found_inf = getattr(optimizer, "found_inf", None)
        if len(optimizer.state) > self.states_before and found_inf is not None and found_inf.item():
            for p in list(optimizer.state)[self.states_before :]:
                del optimizer.state[p]

    def due(self, tick: Tick) -> bool:
        """A report falls at this meeting even where the host would not wait (the same on every rank)."""
        return tick.step - self.reported >= MAX_UNREPORTED

    def report(self, tick: Tick) -> dict:
        """Where every rank meets and the host waits anyway: the steps since the last report that were
        skipped on the device. `error` raises on every rank alike, each naming its own first such step
        (or, where it had none, the first any rank had); `skip` returns this rank's count for the row."""
        self.reported = tick.step
        bad = list(self.bad_on_host)
        self.bad_on_host = []
        if self.on_device and self.steps:
            taken = len(self.steps)
            flags = self.flags[:taken].to("cpu", torch.bool).tolist()
            self.flags[:taken].zero_()
            bad = [step for step, flag in zip(self.steps, flags) if flag]
            self.steps = []
        if self.policy == "error":
            first = torch.tensor([bad[0] if bad else NONE_BAD], dtype=torch.int64, device=self.device)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)  # every rank stops, or none
            if (anywhere := int(first.item())) != NONE_BAD:
                self._handle(tick.step, bad, anywhere)
        elif bad and self.on_device:
            self._handle(tick.step, bad, None)
        return {metrics.TRAIN_SKIPPED_NONFINITE: len(bad)} if bad and self.on_device else {}

    def _handle(self, step: int, bad: list[int], anywhere: int | None) -> None:
        """Raise for `error`; log for `skip`. `bad`: this rank's steps that were not finite, the first first;
        `anywhere`: the first any rank had, where a report agreed on one."""
        if self.policy == "error":
            if self.on_device:
                where = (
                    "its update was skipped on the device, as any non-finite step's is, and training stopped at "
                    f"step {step}, where every rank next read the check (log steps, evals, saves, averaging)"
                )
            elif self.steps_in_backward:
                where = "stopped before averaging and saving (optimizer.in_backward: the step itself ran in backward)"
            elif bad and bad[0] != step:
                where = f"its update was skipped, and training stopped at step {step}, where every rank next met"
            else:
                where = "stopped before the optimizer step"
            which = f"step {bad[0]}" if bad else f"step {anywhere} of another replica (this one's were finite)"
            raise NonFiniteLossError(
                f"train: the loss or gradients are not finite (NaN/inf) at {which}; {where}, so no checkpoint "
                "holds non-finite values. Fix: lower optimizer.lr, keep train.grad_clip > 0, resume from the last "
                "checkpoint, or train.nonfinite=skip to skip such steps."
            )
        steps = ", ".join(map(str, bad))
        log.warning("step(s) %s: non-finite loss or gradients; skipped (train.nonfinite=skip)", steps)


NONE_BAD = 2**62  # no bad step: above every step
