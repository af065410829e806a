"""Gradient sync across replicas: during warmup with an averager, all the
time without one (then only counted, where the layout reduces them itself).

- FSDP2: each replica is sharded on `mesh["shard"]` only; a hook set with
  `set_all_reduce_hook` on every FSDP module all-reduces the reduce-scatter
  output over the replicate group during warmup and does nothing after it.
  (`set_requires_all_reduce(False)` looks like the switch but is gradient
  accumulation: grads are held back and parameters never change.)
- A replica of one device (a plain module): its `GradientReduction` starts the
  same mean on buckets of its gradients as backward produces them, and waits
  once when backward ends; synchronous training has no native reduction
  there, so it always means over the replicas.
- DDP: what PyTorch's `post_localSGD_hook` does (the mean over the replicate
  group during warmup, over the replica's own ranks after it), with the run's
  clock deciding which instead of the hook's own iteration counter.

Each asks the run's clock whether the step being taken is synchronous.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from harness.averaging.averagers import ReplicaAverager
from harness.averaging.collectives import MeanInFlight, start_mean_over_group
from harness.averaging.gradient_reduction import GradientReduction
from harness.averaging.link import MeshLink, ReplicaLink
from harness.averaging.traffic import CrossReplicaTraffic


def sync_gradients_during_warmup(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    averager: ReplicaAverager,
    traffic: CrossReplicaTraffic,
    reduction: GradientReduction | None = None,
) -> None:
    """Average gradients across replicas while the clock's step is synchronous."""
    clock = averager.clock
    if isinstance(model, DistributedDataParallel):
        replicas, own = mesh.get_group("replicate"), mesh.get_group("shard")

        def ddp_hook(_, bucket):  # unannotated: DDP rejects string annotations (__future__)
            if clock.synchronous:
                traffic.add_grad(bucket.buffer())
                return default_hooks.allreduce_hook(replicas, bucket)
            return default_hooks.allreduce_hook(own, bucket)  # post_localSGD_hook's subgroup: the replica's ranks

        model.register_comm_hook(None, ddp_hook)
        return
    reduce_over_replicas(model, reduction, averager.link, traffic, active=lambda: clock.synchronous)


def start_mean_over_replicas(gradient: torch.Tensor, link: ReplicaLink, traffic: CrossReplicaTraffic) -> MeanInFlight:
    """Start replacing a reduced gradient (FSDP2's reduce output, or a bucket of a one-device replica's
    gradients) by its mean over the replicas, in place, counting its bytes."""
    traffic.add_grad(gradient)
    return start_mean_over_group(gradient, link, gradient.dtype)


def reduce_over_replicas(
    model: torch.nn.Module,
    reduction: GradientReduction | None,
    link: ReplicaLink,
    traffic: CrossReplicaTraffic,
    active=lambda: True,
) -> None:
    """While `active()`, each gradient reduction of a replica is followed by the mean over the replicas:
    its `GradientReduction`'s buckets (started as they fill, waited for when backward ends), or every FSDP
    module's reduce-scatter output (FSDP2's all-reduce hook, waited for in the hook)."""
    if reduction is not None:
        reduction.set_all_reduce_hook(lambda flat: start_mean_over_replicas(flat, link, traffic), active)
        return

    def hook(reduced: torch.Tensor) -> None:
        if active():
            start_mean_over_replicas(reduced, link, traffic).wait()

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)


def count_synchronous_gradients(
    model: torch.nn.Module, traffic: CrossReplicaTraffic, reduction: GradientReduction | None, mesh: DeviceMesh
) -> None:
    """Synchronous multi-replica training: count the gradient all-reduce the layout already does (DDP, native
    HSDP), or, for replicas of one device, do it (the mean over the mesh's replicate group) and count it."""
    if reduction is not None:
        reduce_over_replicas(model, reduction, MeshLink(mesh.get_group("replicate")), traffic)
        return
    if isinstance(model, DistributedDataParallel):

        def ddp_hook(group, bucket):  # unannotated: DDP rejects string annotations (__future__)
            traffic.add_grad(bucket.buffer())
            return default_hooks.allreduce_hook(group, bucket)

        model.register_comm_hook(None, ddp_hook)
        return
    for module in model.modules():  # native HSDP calls this after its own cross-replica all-reduce
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(traffic.add_grad)
