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

The host reads what happened only where it waits anyway: on log steps and on
steps that evaluate, save or average, and at least every `MAX_UNREPORTED`
steps, which bounds the flags kept on the device (`report`). `skip` logs there
how many steps were skipped; `error` stops there, naming the first step that
was not finite, at most `train.log_every - 1` steps after it. Either way no
non-finite value was ever applied, so none is saved or averaged (a save also
refuses non-finite state).

Optimizers without `found_inf` (not fused, or `optimizer.in_backward`, whose
steps ran in backward) are checked on the host every step, as before: one
1-element all-reduce and one host sync per step, so every rank takes the same
branch.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from harness import metrics
from harness.dist import true_on_every_rank

log = logging.getLogger(__name__)

MAX_UNREPORTED = 1000  # steps between two reads of the device's flags, at most (one float each)


class NonFiniteLossError(RuntimeError):
    """The loss or gradients became NaN/inf; the message names the step and the fix."""


class NonFiniteGuard:
    """`train.nonfinite` for the loop: `check` every step, `report` where the host waits."""

    def __init__(self, policy: str, optimizer, device: torch.device, log_every: int, steps_in_backward: bool):
        self.policy, self.steps_in_backward = policy, steps_in_backward
        # the fused optimizers read `found_inf` (GradScaler's protocol); in backward the step has already run
        self.on_device = getattr(optimizer, "_step_supports_amp_scaling", False) and not steps_in_backward
        self.optimizer = optimizer
        if self.on_device:
            # one flag per step since the last report: a report falls at least every len(flags) steps
            self.flags = torch.zeros(min(log_every, MAX_UNREPORTED), device=device)
            self.reported = 0  # the last step reported
            optimizer.register_step_pre_hook(self._before_step)
            optimizer.register_step_post_hook(self._after_step)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`; on the device, from `loss·0 + 1` (1 for a finite loss, NaN otherwise), so that
        a non-finite loss makes every gradient NaN, which the gradient norm's check sees on every rank
        that shares the gradients. The host's check reads the loss itself."""
        loss.backward(loss.detach() * 0 + 1 if self.on_device else None)

    def check(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None, group: dist.ProcessGroup | None = None
    ) -> bool:
        """Whether the optimizer may step. On the device: always (a non-finite step is
        skipped there); on the host: the step's check, agreed by every rank (of `group`: those
        that took this step together), raising for `error` and logging for `skip`."""
        if self.on_device:
            flag = self.flags[step % len(self.flags)]
            # 0·x is 0 for a finite x and NaN for NaN and ±inf: not finite in two ops (isfinite is four, + a not)
            torch.ne(grad_norm * 0, 0, out=flag)
            self.optimizer.found_inf = flag
            return True
        finite = torch.isfinite(loss.detach()).all()
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm)
        if true_on_every_rank(finite, group):
            return True
        self._handle(step, [step])
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

    def due(self, step: int) -> bool:
        """The device's flags are full: report at this step even where the host would not wait."""
        return self.on_device and step - self.reported >= len(self.flags)

    def report(self, step: int) -> dict:
        """Where the host waits anyway: the steps since the last report that were skipped on the
        device. `error` raises on every rank alike, naming the first such step of any rank;
        `skip` returns this rank's count for the row."""
        if not self.on_device:
            return {}
        since, self.reported = max(self.reported, step - len(self.flags)), step
        flags = self.flags.to("cpu", torch.bool)
        self.flags.zero_()  # a step jumped over (a heal, a resume) must not find an old flag in its slot
        bad = [s for s in range(since + 1, step + 1) if flags[s % len(flags)]]
        if self.policy == "error":
            first = torch.tensor([bad[0] if bad else step + 1], device=self.flags.device)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)  # every rank stops, or none
            if (first_step := int(first.item())) <= step:
                self._handle(step, [first_step])
        elif bad:
            self._handle(step, bad)
        return {metrics.TRAIN_SKIPPED_NONFINITE: len(bad)} if bad else {}

    def _handle(self, step: int, bad: list[int]) -> None:
        """Raise for `error`; log for `skip`. `bad`: the steps that were not finite, the first first."""
        if self.policy == "error":
            if self.on_device:
                where = (
                    "its update was skipped on the device, as any non-finite step's is, and training stopped at "
                    f"step {step}, where the host next read the check (log steps, evals, saves, averaging)"
                )
            elif self.steps_in_backward:
                where = "stopped before averaging and saving (optimizer.in_backward: the step itself ran in backward)"
            else:
                where = "stopped before the optimizer step"
            raise NonFiniteLossError(
                f"train: the loss or gradients are not finite (NaN/inf) at step {bad[0]}; {where}, so no checkpoint "
                "holds non-finite values. Fix: lower optimizer.lr, keep train.grad_clip > 0, resume from the last "
                "checkpoint, or train.nonfinite=skip to skip such steps."
            )
        steps = ", ".join(map(str, bad))
        log.warning("step(s) %s: non-finite loss or gradients; skipped (train.nonfinite=skip)", steps)
