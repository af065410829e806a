"""Post-local SGD (arXiv 1808.07217) across the `replicate` dimension of the mesh.

Until `warmup_steps` every step is synchronous: gradients are averaged across
replicas. From then on no gradient crosses replicas - each replica trains on its
own data - and every `period` steps, after the local optimizer step, the
*parameters* are averaged across replicas. Inside a replica the ranks hold
different shards, so nothing is averaged along `shard`.

- FSDP2: each replica is sharded on `mesh["shard"]` only; a hook set with
  `set_all_reduce_hook` on every FSDP module all-reduces the reduce-scatter
  output over the replicate group during warmup and does nothing after it.
  (`set_requires_all_reduce(False)` looks like the switch but is gradient
  accumulation: grads are held back and parameters never change.)
- DDP: PyTorch's `post_localSGD_hook`, with the replica's own ranks as the
  explicit subgroup (on CPU, `subgroup=None` fails at `start_localSGD_iter`).
- Parameters: `ReplicaAverager`, driven by PyTorch's `PostLocalSGDOptimizer`,
  averages each rank's *local shard* in place (see its docstring for why the
  stock `PeriodicModelAverager` is not used).

The averager's `step` and `warmup_steps` are the one clock both the gradient
hook and the averaging schedule read.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

from harness import metrics
from harness.dist import local_view, synchronize

BUCKET_BYTES = 64 * 2**20  # cap on one flat all-reduce buffer


@dataclass
class CrossReplicaTraffic:
    """Bytes this rank put into cross-replica collectives (the reduced buffers'
    sizes in the dtype they were sent in; a ring all-reduce sends about
    2(R-1)/R times that on the wire), and the figures of this step's averaging."""

    grad_sync_bytes: int = 0
    averaging_bytes: int = 0
    total_bytes: int = 0
    averaged: dict | None = None  # this step's averaging metrics (averager/drift, averager/time_s, ...)

    def add_grad(self, tensor: torch.Tensor) -> None:
        self.grad_sync_bytes += tensor.numel() * tensor.element_size()

    def step_metrics(self, averager_step: int | None) -> dict:
        """This step's figures, then reset for the next step."""
        self.total_bytes += self.grad_sync_bytes + self.averaging_bytes
        row = {
            metrics.COMM_GRAD_SYNC_BYTES: self.grad_sync_bytes,
            metrics.COMM_AVERAGING_BYTES: self.averaging_bytes,
            metrics.COMM_TOTAL_BYTES: self.total_bytes,
        }
        if averager_step is not None:
            row.update(
                {metrics.AVERAGER_AVERAGED: int(self.averaged is not None), metrics.AVERAGER_STEP: averager_step}
            )
            row.update(self.averaged or {})
        self.grad_sync_bytes = self.averaging_bytes = 0
        self.averaged = None
        return row


class ReplicaAverager(ModelAverager):
    """`PeriodicModelAverager`'s schedule over the replicate group, on local shards.

    The stock averager cannot average FSDP2 parameters (verified on torch 2.13):
    on DTensors, `c10d.allreduce_` has no sharding strategy / uneven shards
    cannot be flattened; on `to_local()` tensors it filters everything out
    because their `.grad` is None; and `utils.average_parameters` on them is a
    silent no-op (it rebinds `.data` of temporaries). This one all-reduces a
    flat copy of the local shards in buckets and `copy_`s the mean back in
    place: 1/shard of the model per rank, no all-gather. It works on plain
    tensors (DDP) too, so both paths report the same drift and bytes.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        comm_dtype: str = "float32",
    ):
        super().__init__(mesh.get_group("replicate"))
        self.period, self.warmup_steps, self.traffic = period, warmup_steps, traffic
        self.comm_dtype = getattr(torch, str(comm_dtype))

    @staticmethod
    def config_errors(cfg: DictConfig, replicas: int) -> list[str]:
        """Why `cfg` (the whole config) cannot average over `replicas` replicas; checked by `validate`."""
        return _period_errors(cfg.averager) + _warmup_errors(cfg.averager)

    def group_to_average(self) -> dist.ProcessGroup | None:
        due = self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0
        return self.process_group if due else None

    def average_parameters(self, params) -> None:
        group = self.group_to_average()
        if group is not None:
            time_s, self.traffic.averaging_bytes, drift = average_local_shards(params, group, self.comm_dtype)
            self.traffic.averaged = {metrics.AVERAGER_DRIFT: drift, metrics.AVERAGER_TIME: time_s}
        self.step += 1


class HierarchicalReplicaAverager(ReplicaAverager):
    """`HierarchicalModelAverager`'s schedule: at a step past warmup, the largest
    period dividing the step picks the group size to average within."""

    def __init__(
        self,
        period_group_size: list[list[int]],
        warmup_steps: int,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        comm_dtype: str = "float32",
    ):
        super().__init__(max(p for p, _ in period_group_size), warmup_steps, mesh, traffic, comm_dtype)
        self.period_groups = {int(p): replica_subgroups(mesh, int(g)) for p, g in period_group_size}

    @staticmethod
    def config_errors(cfg: DictConfig, replicas: int) -> list[str]:
        cfg = cfg.averager
        pairs = [list(pair) for pair in cfg.period_group_size]
        key = f"averager.period_group_size={pairs}".replace(" ", "")
        example = (
            f"averager.period_group_size=[[2,2],[8,{replicas}]]"
            if replicas > 2
            else "averager.period_group_size=[[4,2]]"
        )
        if not pairs or any(len(pair) != 2 for pair in pairs):
            return [f"{key} must be a non-empty list of [period, group_size] pairs. Fix: e.g. {example}."]
        periods, sizes = [p for p, _ in pairs], [g for _, g in pairs]
        problems = []
        if any(p < 1 for p in periods) or periods != sorted(set(periods)):
            problems.append("periods (the first numbers) must be >= 1 and strictly increasing")
        if any(g < 1 or replicas % g for g in sizes):
            problems.append(f"every group size must divide the replica count {replicas}")
        elif any(b % a for a, b in zip(sizes, sizes[1:])):
            problems.append("each group size must divide the next (groups nest)")
        if sizes and sizes[-1] != replicas:
            problems.append(f"the largest period must average all {replicas} replicas (last group size = {replicas})")
        errors = [f"{key} is not a valid hierarchy: {'; '.join(problems)}. Fix: e.g. {example}."] if problems else []
        return errors + _warmup_errors(cfg)

    def group_to_average(self) -> dist.ProcessGroup | None:
        if self.step < self.warmup_steps:
            return None
        return next(
            (self.period_groups[p] for p in sorted(self.period_groups, reverse=True) if self.step % p == 0), None
        )


def _period_errors(cfg: DictConfig) -> list[str]:
    if cfg.period >= 1:
        return []
    return [
        f"averager.period={cfg.period} is out of range: it must be >= 1. Fix: averager.period=4 averages every 4 steps."
    ]


def _warmup_errors(cfg: DictConfig) -> list[str]:
    if cfg.warmup_steps >= 0:
        return []
    return [
        f"averager.warmup_steps={cfg.warmup_steps} is out of range: it must be >= 0. "
        "Fix: averager.warmup_steps=0 starts local SGD at once."
    ]


@torch.no_grad()
def average_local_shards(params, group: dist.ProcessGroup, comm_dtype: torch.dtype) -> tuple[float, int, float]:
    """Average the local shards of `params` (tensors or param groups) over `group`, in place.

    Returns (seconds, bytes sent, drift), where drift is how far the members
    had drifted apart just before: sqrt(sum ||x_r - mean||^2 / sum ||mean||^2)
    over every rank's shards, from the same buffers (one 2-float all-reduce).
    """
    tensors = [local_view(p) for p in _flatten(params)]
    device = tensors[0].device
    synchronize(device)  # the clock measures the averaging alone, finished
    start, nbytes = time.perf_counter(), 0
    deviation = torch.zeros(2, dtype=torch.float64, device=device)  # [sum dev^2, sum mean^2]
    for indices in buckets(tensors):
        bucket = [tensors[i] for i in indices]
        local = torch.cat([t.reshape(-1) for t in bucket])
        mean = local.clone()
        nbytes += mean_over_group(mean, group, comm_dtype)
        deviation[0] += local.sub_(mean).pow_(2).sum()
        deviation[1] += mean.square().sum()
        torch._foreach_copy_(bucket, [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in bucket]), bucket)])
    synchronize(device)
    elapsed = time.perf_counter() - start
    dist.all_reduce(deviation)
    return elapsed, nbytes, (deviation[0] / deviation[1].clamp_min(1e-30)).sqrt().item()


def mean_over_group(flat: torch.Tensor, group: dist.ProcessGroup, comm_dtype: torch.dtype) -> int:
    """Replace the 1-D `flat` by its mean over `group`; returns the bytes sent.

    In its own dtype: one all-reduce. In a narrower `comm_dtype` (bf16): an
    all-reduce in that dtype would also *sum* in it, so instead each rank gets
    its 1/n chunk of every member's copy (all-to-all), sums those in fp32 and
    all-gathers the means - the reduce-scatter + all-gather of a ring
    all-reduce, with every byte on the wire in `comm_dtype`.
    """
    n = group.size()
    if comm_dtype == flat.dtype:
        dist.all_reduce(flat, group=group)
        flat.div_(n)
        return flat.numel() * flat.element_size()
    chunk = -(-flat.numel() // n)
    sent = torch.zeros(chunk * n, dtype=comm_dtype, device=flat.device)
    sent[: flat.numel()].copy_(flat)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    mine = received.view(n, chunk).float().sum(0).div_(n).to(comm_dtype)
    dist.all_gather_into_tensor(sent, mine, group=group)
    flat.copy_(sent[: flat.numel()])
    return flat.numel() * sent.element_size()


def _flatten(params) -> list[torch.Tensor]:
    out = []
    for p in params:
        out.extend(p["params"] if isinstance(p, dict) else [p])
    return out


def buckets(tensors: list[torch.Tensor]):
    """Indices into `tensors`, in runs of one dtype and at most BUCKET_BYTES (or one tensor)."""
    bucket, nbytes = [], 0
    for i, t in enumerate(tensors):
        if bucket and (nbytes + t.numel() * t.element_size() > BUCKET_BYTES or t.dtype != tensors[bucket[0]].dtype):
            yield bucket
            bucket, nbytes = [], 0
        bucket.append(i)
        nbytes += t.numel() * t.element_size()
    if bucket:
        yield bucket


def replica_subgroups(mesh: DeviceMesh, group_size: int) -> dist.ProcessGroup:
    """This rank's group of `group_size` consecutive replicas (same shard index);
    the replicate group itself when the group holds every replica."""
    ranks = mesh.mesh  # [replicate, shard] tensor of global ranks
    if group_size == ranks.shape[0]:
        return mesh.get_group("replicate")
    groups = [
        ranks[first : first + group_size, shard].tolist()
        for shard in range(ranks.shape[1])
        for first in range(0, ranks.shape[0], group_size)
    ]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


def setup_cross_replica(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, cfg: DictConfig
) -> tuple[torch.optim.Optimizer, CrossReplica | None]:
    """Wire gradient sync and parameter averaging across replicas for `cfg` (= cfg.averager).

    Returns the optimizer to step (PostLocalSGDOptimizer when averaging) and
    the object that reports this step's cross-replica figures, or None when
    the layout has a single replica (nothing crosses replicas).
    """
    if mesh["replicate"].size() < 2:
        return optimizer, None
    traffic = CrossReplicaTraffic()
    if cfg.get("_target_") is None:  # averager=none: synchronous
        _count_synchronous_gradients(model, traffic)
        return optimizer, CrossReplica(traffic, None)
    # partial first: instantiate would merge (and copy) keyword objects into the config;
    # not recursive: nested configs (DiLoCo's outer optimizer) are the averager's to build
    build = instantiate(cfg, _partial_=True, _recursive_=False)
    wants_model = "model" in inspect.signature(build.func).parameters  # DiLoCo: its own copy of the parameters
    averager = build(mesh=mesh, traffic=traffic, **({"model": model} if wants_model else {}))
    ddp_state = _sync_gradients_during_warmup(model, mesh, averager, traffic)
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager), CrossReplica(traffic, averager, ddp_state)


@dataclass
class CrossReplica:
    traffic: CrossReplicaTraffic
    averager: ReplicaAverager | None
    ddp_state: PostLocalSGDState | None = None  # the DDP hook's own iteration counter

    @property
    def averaged_this_step(self) -> bool:
        """The step just taken averaged (or synced) across replicas; reset by `step_metrics`."""
        return self.traffic.averaged is not None

    def step_metrics(self) -> dict:
        return self.traffic.step_metrics(self.averager.step if self.averager is not None else None)

    def state_dict(self) -> dict:
        return {
            "averager_step": self.averager.step if self.averager is not None else None,
            "cross_replica_bytes_total": self.traffic.total_bytes,
            **({"averager": self.averager.state_dict()} if hasattr(self.averager, "state_dict") else {}),
        }

    def tensor_state_dict(self) -> dict:
        """The averager's own tensors (DiLoCo's outer parameters and state), if any."""
        return self.averager.tensor_state_dict() if hasattr(self.averager, "tensor_state_dict") else {}

    def load_tensor_state_dict(self, state: dict | None) -> None:
        if hasattr(self.averager, "load_tensor_state_dict"):
            self.averager.load_tensor_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters; the checkpoint's global `step` stands in for an
        averager step it does not have (saved without an averager)."""
        self.traffic.total_bytes = state.get("cross_replica_bytes_total", 0)
        if self.averager is not None:
            self.averager.step = state.get("averager_step") or state["step"]
            if self.ddp_state is not None:
                self.ddp_state.iter = self.averager.step
            if hasattr(self.averager, "load_state_dict"):
                self.averager.load_state_dict(state.get("averager", {}))


def _sync_gradients_during_warmup(
    model: torch.nn.Module, mesh: DeviceMesh, averager: ReplicaAverager, traffic: CrossReplicaTraffic
) -> PostLocalSGDState | None:
    replicate_group = mesh.get_group("replicate")
    if isinstance(model, DistributedDataParallel):
        state = PostLocalSGDState(
            process_group=replicate_group, subgroup=mesh.get_group("shard"), start_localSGD_iter=averager.warmup_steps
        )

        def ddp_hook(state, bucket):  # unannotated: DDP rejects string annotations (__future__)
            if state.iter < state.start_localSGD_iter:
                traffic.add_grad(bucket.buffer())
            return post_localSGD_hook(state, bucket)

        model.register_comm_hook(state, ddp_hook)
        return state

    def fsdp_hook(reduce_output: torch.Tensor) -> None:
        if averager.step < averager.warmup_steps:
            dist.all_reduce(reduce_output, group=replicate_group)
            reduce_output.div_(replicate_group.size())
            traffic.add_grad(reduce_output)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(fsdp_hook)
    return None


def _count_synchronous_gradients(model: torch.nn.Module, traffic: CrossReplicaTraffic) -> None:
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
