"""`train.nonfinite`: what a step whose loss or gradients are NaN/inf does,
decided without reading the device every step.

A fused optimizer (`optimizer.fused`, the default on CUDA) skips its whole
update, moments and step count included, when its `found_inf` tensor is 1:
the flag `torch.amp.GradScaler` sets for it. So each step costs a few device
ops: the flag is the gradient norm's finiteness, which is the same on every
rank of a replica (the norm is reduced over the replica's shards) and covers
the loss (a NaN/inf loss makes every gradient NaN/inf, and the gradient
reduction spreads it to every rank of the replica). A replica that skips a
local step alone is fine: it still takes part in every collective.

The host reads what happened only where it waits anyway: on log steps and on
steps that evaluate, save or average (`report`). `skip` logs there how many
steps were skipped; `error` stops there, naming the first step that was not
finite, at most `train.log_every - 1` steps after it. Either way no
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
            # one flag per step since the last report: a report falls at least every log_every steps
            self.flags = torch.zeros(log_every, device=device)
            self.reported = 0  # the last step reported

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Whether the optimizer may step. On the device: always (a non-finite step is
        skipped there); on the host: the step's check, agreed by every rank, raising for
        `error` and logging for `skip`."""
        if self.on_device:
            flag = self.flags[step % len(self.flags)]
            # 0·x is 0 for a finite x and NaN for NaN and ±inf: not finite in two ops (isfinite is four, + a not)
            torch.ne(grad_norm * 0, 0, out=flag)
            self.optimizer.found_inf = flag
            return True
        finite = torch.isfinite(loss.detach()).all()
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm)
        if true_on_every_rank(finite):
            return True
        self._handle(step, [step])
        return False

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
