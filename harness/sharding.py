"""Apply a sharding strategy to a meta-device model and materialise it.

FSDP2 (`fully_shard`) covers every strategy but `ddp` where a replica spans
several ranks: one call per block, then the root, on the (replicate, shard)
mesh. A single-replica layout uses the `shard` sub-mesh; several replicas use
the 2-D mesh (native HSDP), unless the replicas train on their own (post-local
SGD): then each replica is sharded on `shard` alone and `harness.averaging`
decides what crosses replicas.

A replica of one device (shard size 1: one GPU, `no_shard`, a replica group of
one rank) has nothing to shard, so it is not wrapped: FSDP2 at shard size 1
only adds copies, views and collectives of one rank to every step. It is a
plain module with fp32 parameters computing under autocast, as `ddp`'s; where
its gradients cross replicas, `harness.gradient_reduction` reduces them, as
DDP's reducer does for DDP.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from harness.config import ShardingConf
from harness.models import materialize

RESHARD_AFTER_FORWARD = {
    "full_shard": True,
    "hybrid_shard": True,
    "shard_grad_op": False,
    "hybrid_shard_zero2": False,
    "no_shard": False,
}


def resolve_dtype(name: str, device: torch.device, *, low_precision_on_cuda: bool) -> torch.dtype:
    """`auto`: bf16 compute params on CUDA, fp32 on CPU; reductions stay fp32."""
    if name == "auto":
        return torch.bfloat16 if low_precision_on_cuda and device.type == "cuda" else torch.float32
    return getattr(torch, name)


def checkpoint_activations(model: nn.Module, mode: str) -> None:
    """`model.activation_checkpointing`: recompute blocks' activations in backward
    instead of keeping them, through PyTorch's non-reentrant checkpointing —
    `full` every block, `selective` every other block (torchtitan's layer-level
    selective AC). Applied before compiling and sharding, as torchtitan does.

    The block's forward is replaced, not the module wrapped, so parameter names
    (and with them the seeded initial values and checkpoint keys) stay as they
    are; FSDP2's hooks stay on the block, whose backward all-gathers the
    parameters before the recompute runs. The RNG state is preserved, so
    dropout recomputes the same mask and training is unchanged bit for bit.
    """
    if mode == "none":
        return
    for index, block in enumerate(model.blocks):
        if mode == "full" or index % 2 == 0:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_blocks(model: nn.Module) -> None:
    """`torch.compile` each block's forward, as torchtitan compiles per block, and
    the model's `output_loss` (final norm, output projection and the fp32
    cross-entropy over the vocabulary: a quarter of a 163M GPT's GPU time eager),
    where the model has one.

    The forwards, not the modules: FSDP2's hooks stay outside the compiled
    graphs, and parameter names (so checkpoints, and initial values, which are
    seeded by name) are the same as without compiling.
    """
    for block in model.blocks:
        block.forward = torch.compile(block.forward)
    if hasattr(model, "output_loss"):
        model.output_loss = torch.compile(model.output_loss)


def compile_model(model: nn.Module, one_device: bool) -> None:
    """`train.compile`: a replica of one device compiles the whole model and its loss
    in one graph (`nn.Module.compile`, which keeps parameter names); a sharded or
    DDP replica compiles per block (`compile_blocks`), outside FSDP2's and DDP's hooks."""
    if one_device:
        model.compile()
    else:
        compile_blocks(model)


def one_device_replica(cfg: ShardingConf, shard: int) -> bool:
    """A replica is one rank, and the strategy is not `ddp`: a plain module, no FSDP2."""
    return shard == 1 and cfg.strategy != "ddp"


def autocast_forward(model: nn.Module, cfg: ShardingConf, device: torch.device) -> None:
    """fp32 parameters computing in `sharding.param_dtype` (bf16 on CUDA by default) under
    autocast, as FSDP2's mixed-precision policy computes: for the layouts without FSDP2."""
    compute_dtype = resolve_dtype(cfg.param_dtype, device, low_precision_on_cuda=True)
    if compute_dtype != torch.float32:
        model.forward = torch.autocast(device.type, dtype=compute_dtype)(model.forward)


def apply_sharding(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: ShardingConf,
    device: torch.device,
    seed: int,
    replicas_train_alone: bool = False,
    init_from: str | None = None,
) -> nn.Module:
    if one_device_replica(cfg, mesh["shard"].size()):
        materialize(model, device, seed, init_from)
        autocast_forward(model, cfg, device)
        return model
    if cfg.strategy == "ddp":
        materialize(model, device, seed, init_from)
        autocast_forward(model, cfg, device)
        # find_unused_parameters=True is the one switch that stops DDP from
        # rebuilding its gradient buckets in gradient-ready order after the first
        # iteration. A resumed run starts on the initial buckets, so at 4+ ranks
        # each gradient would land in another ring-all-reduce chunk, be summed in
        # another order, and differ by ~1 ulp from an uninterrupted run. The cost
        # is one autograd-graph traversal per step.
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True
        )
    fsdp_mesh = mesh if mesh["replicate"].size() > 1 and not replicas_train_alone else mesh["shard"]
    policy = MixedPrecisionPolicy(
        param_dtype=resolve_dtype(cfg.param_dtype, device, low_precision_on_cuda=True),
        reduce_dtype=resolve_dtype(cfg.reduce_dtype, device, low_precision_on_cuda=False),
    )
    reshard = RESHARD_AFTER_FORWARD[cfg.strategy]
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    materialize(model, device, seed, init_from)
    return model
