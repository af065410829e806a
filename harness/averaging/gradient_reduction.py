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

A parameter whose gradient the last micro-batch did not produce, as DDP's reducer with
`find_unused_parameters` treats it: it joins its bucket, when backward ends, with what autograd
accumulated on the step's earlier micro-batches (its `.grad`), or zeros where it has none; after
the buckets, one small mean of which parameters have a gradient on this rank (DDP's
`local_used_map`) tells which ones no replica has, and those keep `grad=None`, as on a local step
(no weight decay, no momentum). That mask is read on the host only by a rank that lacks a gradient.
Autograd's `.grad` is the record of use over the step's micro-batches: the loop sets gradients to
None between steps (`zero_grad(set_to_none=True)`).

With `bucket_bytes=0`, one parameter at a time, waited for in its own hook: a parameter stepped
in backward (`optimizer.in_backward`, whose hooks are registered after these) steps on the
reduced gradient. Every rank must then produce the same parameters' gradients on the last
micro-batch (their means are issued in hook order); one with a gradient from an earlier
micro-batch only is reduced when backward ends, in parameter order.

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
        self.accumulated = False  # a backward that only accumulated ran since the step's last one
        self.reduced_alone: set[nn.Parameter] = set()  # bucket_bytes=0: reduced in their hooks this backward
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def set_all_reduce_hook(self, start_mean: Callable[[torch.Tensor], Work], active: Callable[[], bool]) -> None:
        """`start_mean(flat)` starts replacing `flat` by its mean over the replicas and returns what
        to wait for; `active()` says whether the coming backward's gradients cross replicas."""
        self.start_mean, self.active = start_mean, active

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        self.requires_sync = requires_sync
        self.accumulated |= not requires_sync

    @torch.no_grad()
    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self._reducing_this_backward():
            return
        if not self.bucket_bytes:
            self._reduce_alone(param.grad)
            self.reduced_alone.add(param)
            return
        bucket, position = self.bucket_of[param]
        bucket.grads[position] = param.grad
        bucket.filled += 1
        self._launch_filled_buckets()

    def _reducing_this_backward(self) -> bool:
        """At a backward's first gradient: drop what an earlier backward left (one that raised),
        decide whether this one reduces, and if it reduces, have it finish when it ends (in buckets:
        always; one parameter at a time: after micro-batches that only accumulated)."""
        task = torch._C._current_graph_task_id()
        if task == self.graph_task:
            return self.reducing
        self._drop_unfinished()
        self.graph_task = task
        crosses = self.start_mean is not None and self.active()
        self.reducing = crosses and self.requires_sync  # not on a micro-batch that only accumulates
        after_accumulating = self.accumulated and self.requires_sync
        self.accumulated &= not self.requires_sync  # the step's last backward: the next step starts afresh
        if not self.bucket_bytes:
            self.reduced_alone = set()
            if self.reducing and after_accumulating:  # the same on every rank: the micro-batch schedule
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_alone)
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

    def _reduce_alone(self, grad: torch.Tensor) -> None:
        reduced = grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)
        self.start_mean(reduced).wait()
        if reduced is not grad:
            grad.copy_(reduced)

    @torch.no_grad()
    def _finish_alone(self) -> None:
        """`bucket_bytes=0`, when a step's last backward ends: the parameters it produced no gradient
        for (the same on every rank) had no hook to reduce the gradient of the step's earlier
        micro-batches; here, in parameter order, those that some replica has a gradient for."""
        rest = [p for p in self.params if p not in self.reduced_alone]
        if not rest:
            return
        mask, work = self._start_mask([p.grad is not None for p in rest])
        work.wait()
        for p, any_rank in zip(rest, (mask > 0).tolist()):
            if any_rank:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                self._reduce_alone(grad)
                p.grad = grad

    def _start_mask(self, has_grad: list[bool]) -> tuple[torch.Tensor, Work]:
        """Start the mean over the replicas of which parameters have a gradient on this rank (1 or 0
        each, in `reduce_dtype`): above 0 where any replica has one."""
        device = self.params[0].device
        if all(has_grad):  # no copy from the host (on CUDA a blocking copy waits for the stream)
            mask = torch.ones(len(has_grad), dtype=self.reduce_dtype, device=device)
        else:
            mask = torch.tensor(has_grad, dtype=self.reduce_dtype).to(device)
        return mask, self.start_mean(mask)

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
        `all_remaining`, every bucket left: a parameter without a gradient counts as zeros)."""
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
        """When backward ends: a parameter this backward gave no gradient brings the step's earlier
        micro-batches' (its `.grad`, or none); the buckets left and the mask are started, and every
        mean, waited for once, goes back into the gradients, or becomes the gradient of a parameter
        this rank has none for but another replica has."""
        for bucket in self.buckets:
            bucket.grads = [g if g is not None else p.grad for g, p in zip(bucket.grads, bucket.params)]
        self._launch_filled_buckets(all_remaining=True)
        has_grad = [g is not None for bucket in self.buckets for g in bucket.grads]
        mask, used = self._start_mask(has_grad)  # after every bucket: the same order on every rank
        for bucket in self.buckets:
            bucket.mean.wait()
        used.wait()
        any_rank = has_grad if all(has_grad) else (mask > 0).tolist()
        first = 0
        for bucket in self.buckets:
            for p, grad, slot, anywhere in zip(bucket.params, bucket.grads, bucket.slots, any_rank[first:]):
                if grad is None and anywhere:  # the replicas' mean is its gradient
                    p.grad = slot.to(p.dtype, copy=True)
            first += len(bucket.params)
            grads = [g for g in bucket.grads if g is not None]
            if grads:  # none where no parameter of the bucket has a gradient on this rank
                torch._foreach_copy_(grads, [s for g, s in zip(bucket.grads, bucket.slots) if g is not None])
            bucket.grads, bucket.mean = [], None

    def _drop_unfinished(self) -> None:
        """A backward that raised before its end: wait for the means it started (their buffers are
        about to be reused) and forget its gradients."""
        for bucket in self.buckets or []:
            if bucket.mean is not None:
                bucket.mean.wait()
            bucket.grads, bucket.mean = [], None
