"""Diverged replicas (post-local SGD past warmup): between averaging steps every
replica holds its own parameters and optimizer state. DCP deduplicates equal
keys across ranks and would keep one replica's copy, so each replica saves its
own copy: replica 0 under `model`/`optim` (full: `full.pt`), replica r under
`replica_<r>` (full: `replica_<r>.pt`). A run with the same replica count
restores each replica's own copy (exact resume); any other layout starts every
replica from the mean of the saved copies, and says so in the log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.averaging import local_optimizer
from harness.dist import local_view
from harness.job import Job
from harness.optim import StepInBackward


@dataclass
class Layout:
    """Where this rank sits among the replicas, and whether they can or do differ."""

    replicas: int
    replica: int
    replica_leader: bool  # shard index 0 of its replica: writes the replica's full-mode file
    local_sgd: bool  # replicas train on their own between averaging steps
    diverged: bool  # ... and have done so already (past warmup), so each needs its own copy

    @property
    def copy_key(self) -> str | None:
        """Key of this rank's replica copy: None for the copy every run has (replica 0's)."""
        return copy_key(self.replica) if self.diverged else None


def copy_key(replica: int) -> str | None:
    return f"replica_{replica}" if replica > 0 else None


def replica_layout(job: Job) -> Layout:
    averager = job.cross_replica.averager if job.cross_replica is not None else None
    return Layout(
        replicas=job.mesh["replicate"].size(),
        replica=job.mesh.get_local_rank("replicate"),
        replica_leader=job.mesh.get_local_rank("shard") == 0,
        local_sgd=averager is not None,
        diverged=averager is not None and job.clock.diverged,
    )


def inner_optimizer(optimizer) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """What the state-dict APIs take for the local optimizer: PostLocalSGDOptimizer
    cannot go through them (a fresh one fails in `step(closure=...)`, and its own
    `step` is dropped), so its inner one; for `optimizer.in_backward` the list of
    per-parameter optimizers, which they save and load as one FQN-keyed dict."""
    optimizer = local_optimizer(optimizer)
    return optimizer.optimizers if isinstance(optimizer, StepInBackward) else optimizer


def local_tensors(model: torch.nn.Module, optim) -> list[torch.Tensor]:
    """This rank's parameter shards and floating-point optimizer state (`optim`:
    what `inner_optimizer` returns), as in-place views."""
    states = {}
    for optimizer in optim if isinstance(optim, list) else [optim]:
        states.update(optimizer.state)
    tensors = [local_view(p.data) for p in model.parameters()]
    for p in model.parameters():
        tensors += [
            local_view(v)
            for v in states.get(p, {}).values()
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
        ]
    return tensors


def load_mean_of_copies(job: Job, loaders: list[Callable[[], float]]) -> tuple[float, bool, bool]:
    """Load each copy in turn (a replica's, or a replica group's checkpoint: each of `loaders` loads one and
    returns the seconds it spent setting state dicts) and keep their mean (the first copy itself where every
    copy is equal: the parameters after a run's last exchange, bit for bit). Returns the seconds spent
    setting state dicts, and whether the copies' parameters, and their optimizer states, differ."""
    optim = inner_optimizer(job.optimizer)
    params = sum(1 for _ in job.model.parameters())  # local_tensors lists the parameters first
    first, total, set_s, apart = None, None, 0.0, [False, False]
    for load_copy in loaders:
        set_s += load_copy()
        tensors = local_tensors(job.model, optim)
        if total is None:
            first, total = [t.clone() for t in tensors], [t.clone() for t in tensors]
            continue
        for i, (a, b) in enumerate(zip(first, tensors)):
            apart[i >= params] |= not torch.equal(a, b)
        torch._foreach_add_(total, tensors)
    for i, (t, s, one) in enumerate(zip(local_tensors(job.model, optim), total, first)):
        t.copy_(s / len(loaders) if apart[i >= params] else one)
    return set_s, apart[0], apart[1]
