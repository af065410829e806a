"""Gradient sync across replicas: during warmup with an averager, all the
time without one (then only counted).

- FSDP2: each replica is sharded on `mesh["shard"]` only; a hook set with
  `set_all_reduce_hook` on every FSDP module all-reduces the reduce-scatter
  output over the replicate group during warmup and does nothing after it.
  (`set_requires_all_reduce(False)` looks like the switch but is gradient
  accumulation: grads are held back and parameters never change.)
- DDP: PyTorch's `post_localSGD_hook`, with the replica's own ranks as the
  explicit subgroup (on CPU, `subgroup=None` fails at `start_localSGD_iter`).
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from harness.averaging import schedule
from harness.averaging.averagers import ReplicaAverager
from harness.averaging.traffic import CrossReplicaTraffic


def sync_gradients_during_warmup(
    model: torch.nn.Module, mesh: DeviceMesh, averager: ReplicaAverager, traffic: CrossReplicaTraffic
) -> PostLocalSGDState | None:
    """Average gradients across replicas while the averager's step is synchronous.
    Returns the DDP hook's state (its own iteration counter), None under FSDP2."""
    replicate_group = mesh.get_group("replicate")
    if isinstance(model, DistributedDataParallel):
        state = PostLocalSGDState(
            process_group=replicate_group, subgroup=mesh.get_group("shard"), start_localSGD_iter=averager.warmup_steps
        )

        def ddp_hook(state, bucket):  # unannotated: DDP rejects string annotations (__future__)
            # the hook's own counter, which post_localSGD_hook decides by (it also counts skipped steps)
            if schedule.synchronous(state.iter, state.start_localSGD_iter):
                traffic.add_grad(bucket.buffer())
            return post_localSGD_hook(state, bucket)

        model.register_comm_hook(state, ddp_hook)
        return state

    def fsdp_hook(reduce_output: torch.Tensor) -> None:
        if averager.synchronous:
            averager.link.all_reduce(reduce_output).wait()
            reduce_output.div_(averager.link.size())
            traffic.add_grad(reduce_output)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(fsdp_hook)
    return None


def count_synchronous_gradients(model: torch.nn.Module, traffic: CrossReplicaTraffic) -> None:
    """Synchronous multi-replica training: count the gradient all-reduce it already does."""
    if isinstance(model, DistributedDataParallel):

        def ddp_hook(group, bucket):  # unannotated: DDP rejects string annotations (__future__)
            traffic.add_grad(bucket.buffer())
            return default_hooks.allreduce_hook(group, bucket)

        model.register_comm_hook(None, ddp_hook)
        return
    for module in model.modules():  # native HSDP calls this after its own cross-replica all-reduce
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(traffic.add_grad)
