"""`GradientReduction`: the gradient side of a replica of one device (a plain module: one GPU,
`no_shard`, a replica group of one rank) whose gradients cross replicas (a warmup step,
synchronous training). It is to the plain module what DDP's reducer is to DDP, and what FSDP2's
reduce hands to `set_all_reduce_hook` for a sharded replica.

Bucketed, as DDP's reducer: the parameters in reverse order (about the order backward produces
their gradients) in buckets of about `bucket_bytes`, each with a flat buffer in `reduce_dtype`
kept from step to step. Once every gradient of a bucket is accumulated (on a step's last
micro-batch), they are copied into it and its mean over the replicas is started, buckets in
order, so every rank issues the same collectives in the same order; backward goes on meanwhile.
When backward ends, each bucket is waited for once and the means are copied back into the
gradients. On NCCL a wait makes the current stream wait for the collective, not the host.

With `bucket_bytes=0`, one parameter at a time, waited for in its own hook: a parameter stepped
in backward (`optimizer.in_backward`, whose hooks are registered after these) steps on the
reduced gradient.

Nothing is done, not even a copy, in a backward whose gradients do not cross replicas (`active()`
false: past the warmup) or that only accumulates (`set_requires_gradient_sync(False)`): the
gradients stay autograd's, bit for bit, and the buffers are released.

The state of one backward is keyed by autograd's graph task: a backward that raised leaves it
behind, and the next backward's first gradient drops it (waiting for what it left in flight)
before starting afresh, so a later step's reduction is whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from harness.averaging.link import Work

NO_GRAPH_TASK = -1  # torch._C._current_graph_task_id() outside a backward


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor  # the gradients in reduce_dtype, one after another; kept from step to step
    slots: list[torch.Tensor]  # views of `flat`, shaped as `params`
    grads: list[torch.Tensor | None] = field(default_factory=list)  # this backward's, by position
    filled: int = 0
    mean: Work | None = None  # the mean over the replicas, started


class GradientReduction:
    def __init__(self, model: nn.Module, reduce_dtype: torch.dtype, bucket_bytes: int):
        self.reduce_dtype, self.bucket_bytes = reduce_dtype, bucket_bytes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.start_mean: Callable[[torch.Tensor], Work] | None = None
        self.active: Callable[[], bool] = lambda: True
        self.requires_sync = True
        self.buckets: list[_Bucket] | None = None  # allocated at the first backward that reduces
        self.bucket_of: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        self.graph_task, self.reducing, self.launched = NO_GRAPH_TASK, False, 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def set_all_reduce_hook(self, start_mean: Callable[[torch.Tensor], Work], active: Callable[[], bool]) -> None:
        """`start_mean(flat)` starts replacing `flat` by its mean over the replicas and returns what
        to wait for; `active()` says whether the coming backward's gradients cross replicas."""
        self.start_mean, self.active = start_mean, active

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        self.requires_sync = requires_sync

    @torch.no_grad()
    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self._reducing_this_backward():
            return
        if not self.bucket_bytes:
            self._reduce_alone(param)
            return
        bucket, position = self.bucket_of[param]
        bucket.grads[position] = param.grad
        bucket.filled += 1
        self._launch_filled_buckets()

    def _reducing_this_backward(self) -> bool:
        """At a backward's first gradient: drop what an earlier backward left (one that raised),
        decide whether this one reduces, and if it reduces in buckets, have it finish them when it ends."""
        task = torch._C._current_graph_task_id()
        if task == self.graph_task:
            return self.reducing
        self._drop_unfinished()
        self.graph_task = task
        crosses = self.start_mean is not None and self.active()
        self.reducing = crosses and self.requires_sync  # not on a micro-batch that only accumulates
        if not self.bucket_bytes:
            return self.reducing
        if not crosses:
            self.buckets, self.bucket_of = None, {}  # past the warmup: the buffers are not needed again
        if not self.reducing:
            return False
        if self.buckets is None:
            self._allocate_buckets()
        for bucket in self.buckets:
            bucket.grads, bucket.filled, bucket.mean = [None] * len(bucket.params), 0, None
        self.launched = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return True

    def _reduce_alone(self, param: nn.Parameter) -> None:
        grad = param.grad
        reduced = grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)
        self.start_mean(reduced).wait()
        if reduced is not grad:
            grad.copy_(reduced)

    def _allocate_buckets(self) -> None:
        self.buckets, runs, size = [], [[]], 0
        for p in reversed(self.params):
            if runs[-1] and size + p.numel() * self.reduce_dtype.itemsize > self.bucket_bytes:
                runs.append([])
                size = 0
            runs[-1].append(p)
            size += p.numel() * self.reduce_dtype.itemsize
        device = self.params[0].device
        for params in runs:
            flat = torch.empty(sum(p.numel() for p in params), dtype=self.reduce_dtype, device=device)
            slots = [s.view_as(p) for s, p in zip(flat.split([p.numel() for p in params]), params)]
            bucket = _Bucket(params, flat, slots)
            self.buckets.append(bucket)
            self.bucket_of.update({p: (bucket, i) for i, p in enumerate(params)})

    def _launch_filled_buckets(self, all_remaining: bool = False) -> None:
        """Start the mean of each bucket whose gradients are all in, in bucket order (with
        `all_remaining`, every bucket left: a parameter without a gradient this step counts as zeros)."""
        while self.launched < len(self.buckets):
            bucket = self.buckets[self.launched]
            if bucket.filled < len(bucket.params) and not all_remaining:
                return
            grads = [g if g is not None else torch.zeros_like(s) for g, s in zip(bucket.grads, bucket.slots)]
            torch._foreach_copy_(bucket.slots, grads)  # in reduce_dtype
            bucket.mean = self.start_mean(bucket.flat)
            self.launched += 1

    @torch.no_grad()
    def _finish(self) -> None:
        """When backward ends: every bucket's mean, waited for once, back into the gradients."""
        self._launch_filled_buckets(all_remaining=True)
        for bucket in self.buckets:
            bucket.mean.wait()
            for p, grad, slot in zip(bucket.params, bucket.grads, bucket.slots):
                if grad is None:  # no gradient on this rank: the replicas' mean is its gradient
                    p.grad = slot.to(p.dtype, copy=True)
            grads = [g for g in bucket.grads if g is not None]
            torch._foreach_copy_(grads, [s for g, s in zip(bucket.grads, bucket.slots) if g is not None])
            bucket.grads, bucket.mean = [], None

    def _drop_unfinished(self) -> None:
        """A backward that raised before its end: wait for the means it started (their buffers are
        about to be reused) and forget its gradients."""
        for bucket in self.buckets or []:
            if bucket.mean is not None:
                bucket.mean.wait()
            bucket.grads, bucket.mean = [], None
