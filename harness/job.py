"""What one rank trains with, assembled from the config: `build_job`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh

from harness import float8
from harness.averaging import (
    CrossReplica,
    GradientReduction,
    averaging_schedule,
    local_optimizer,
    setup_cross_replica,
)
from harness.averaging.link import ReplicaLink
from harness.clock import Clock
from harness.data import TokenStream, build_data
from harness.dist import DistEnv
from harness.lr_schedules import LRSchedule, build_lr_schedule
from harness.mesh import build_mesh
from harness.models import build_model
from harness.optim import StepInBackward, build_local_optimizer
from harness.plan import RunPlan
from harness.sharding import (
    apply_sharding,
    checkpoint_activations,
    compile_model,
    one_device_replica,
    resolve_dtype,
)
from harness.slowdown import exchange_delay_s

BUCKET_BYTES = 25 * 2**20  # a replica of one device's gradient buckets across replicas (DDP's default)


class Stateful(Protocol):
    """A named part of a checkpoint (DCP's `Stateful`): its small state goes into
    meta.json under its name. `load_state_dict` also receives the checkpoint's
    `step`.

    A part with tensors also has `tensor_state_dict()`: its tensors in the
    parameters' layout (DTensors under FSDP2, so they reshard with the model),
    sharing storage with the part, written by the checkpoint mode; a load
    fills them in place, after `load_state_dict`, then calls
    `load_tensor_state_dict(those tensors)`, or `(None)` when the checkpoint
    has none (saved by another config)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class _NoState:
    """The part of a layout that has nothing to keep (one replica: no cross-replica state)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class Job:
    """Everything one rank trains with."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: TokenStream
    mesh: DeviceMesh
    clock: Clock  # where the run stands: every part that acts on a schedule asks it
    cross_replica: CrossReplica | None  # None when there is a single replica
    lr_schedule: LRSchedule  # the local optimizer's learning rate, stepped after each optimizer step
    flops_per_token: float  # training FLOPs of the model per token, for train/mfu
    # a replica of one device whose gradients cross replicas: its gradient reduction (None otherwise)
    gradient_reduction: GradientReduction | None = None

    @property
    def steps_in_backward(self) -> bool:
        """The local optimizer steps each parameter during backward (`optimizer.in_backward`)."""
        return isinstance(local_optimizer(self.optimizer), StepInBackward)

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """The stateful parts a checkpoint keeps next to model, optimizer and RNG states, in the order a
        load restores them (the clock first: the data position is anchored to it)."""
        return {
            "clock": self.clock,
            "data": self.data,
            "cross_replica": self.cross_replica or _NoState(),
            "lr_scheduler": self.lr_schedule,
        }


def build_job(cfg: DictConfig, env: DistEnv, plan: RunPlan, link: ReplicaLink | None = None) -> Job:
    """What one rank trains with: the plan's mesh, the model sharded on it and
    materialised, the local optimizer wrapped for averaging, this rank's data.
    `link`: what joins the replicas when they are not ranks of this world (a
    replica group under fault tolerance: its mesh is (1, shard))."""
    mesh = build_mesh(1 if plan.replica_id is not None else plan.replicate, plan.shard, env.device.type)
    model = build_model(cfg.model, cfg.train.seq_len)
    flops_per_token = model.flops_per_token(cfg.train.seq_len)
    one_device = one_device_replica(cfg.sharding, plan.shard)
    float8.convert(model, cfg.train.float8, fsdp=not one_device and cfg.sharding.strategy != "ddp")
    checkpoint_activations(model, cfg.model.activation_checkpointing)
    if cfg.train.compile:
        compile_model(model, one_device)
    model = apply_sharding(
        model,
        mesh,
        cfg.sharding,
        env.device,
        cfg.train.seed,
        replicas_train_alone=plan.averaging,
        init_from=None if plan.resume_from else cfg.model.init_from,  # a resume's weights are the checkpoint's
    )
    reduction = None
    if one_device and plan.replicate > 1:  # before the optimizer: a step in backward takes the reduced gradient
        reduce_dtype = resolve_dtype(cfg.sharding.reduce_dtype, env.device, low_precision_on_cuda=False)
        # in buckets overlapped with backward, unless a parameter steps on its own reduced gradient in backward
        bucket_bytes = 0 if cfg.optimizer.get("in_backward") else BUCKET_BYTES
        reduction = GradientReduction(model, reduce_dtype, bucket_bytes)
    optimizer = build_local_optimizer(cfg.optimizer, model.parameters(), env.device)
    lr_schedule = build_lr_schedule(cfg.lr_scheduler, optimizer, cfg.train.steps)
    clock = Clock(
        averaging_schedule(cfg.averager, plan.averaging),
        cfg.train.steps,
        plan.replicate,
        plan.replica_id if plan.replica_id is not None else mesh["replicate"].get_local_rank(),
        leads=mesh["shard"].get_local_rank() == 0,
        samples_per_step=cfg.train.batch_size * cfg.train.grad_accum * plan.shard,  # one replica's, per local step
        device=env.device,
        sum_over_replicas=link.sum_over_replicas if link is not None else None,
        exchange_delay_s=exchange_delay_s(),  # tests and benches only
    )
    optimizer, cross_replica = setup_cross_replica(
        model, optimizer, mesh, cfg.averager, clock, plan.averaging, link, reduction
    )
    data = build_data(cfg, plan.rank_in_mesh(env.rank), plan.world_size, env.device, clock, plan.shard)
    return Job(model, optimizer, data, mesh, clock, cross_replica, lr_schedule, flops_per_token, reduction)
