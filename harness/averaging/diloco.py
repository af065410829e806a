"""DiLoCo (arXiv 2311.08105) and Streaming DiLoCo's fragments (arXiv 2501.18512)
on the same schedule, mesh and local shards as `ReplicaAverager`.

Every rank keeps an *outer* copy of its local shards, `θ_outer`, equal on every
replica. At a sync, after the local step, each rank forms the pseudo-gradient
`Δ = θ_outer - θ_local`, averages it over the replicate group, takes one step
of the outer optimizer (any `torch.optim` class; DiLoCo's is Nesterov SGD,
lr 0.7, momentum 0.9) with `Δ` as the gradient, and sets `θ_local ← θ_outer`.
With outer SGD at lr 1 and no momentum this is post-local SGD's average.

Syncs come after `period` local steps (the paper's Algorithm 1 and torchft's
`DiLoCo`: after steps W + P, W + 2P, ... for warmup W), not after the first
local step as torch's `PeriodicModelAverager` (`averager=periodic`) does. With
`fragments=F` the model is split into F fragments of whole blocks (embeddings,
final norm and head count as units too), balanced by size; a sync falls every
P/F local steps, the fragments in turn, so fragment f first syncs after
(f+1)·P/F local steps and then every P, and a sync step sends about 1/F of the
model (`schedule.fragment_due`).

`θ_outer` starts as the parameters at the end of warmup (the initial ones when
there is none). The outer optimizer steps plain tensors (the local shards), so
an element-wise optimizer (SGD, Adam, ...) behaves exactly as on whole tensors;
a checkpoint sees them in the parameters' layout (`OuterState`), so they
reshard with the model.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from harness import metrics
from harness.averaging import config_rules, schedule
from harness.averaging.averagers import ReplicaAverager
from harness.averaging.collectives import buckets, mean_over_group
from harness.averaging.traffic import CrossReplicaTraffic
from harness.dist import local_view, synchronize
from harness.optim import build_optimizer

log = logging.getLogger(__name__)


class DiLoCoAverager(ReplicaAverager):
    """Decides when (the schedule), runs a fragment's sync (`outer_step`), and
    reports it; the outer state it keeps is its checkpoint part."""

    config_errors = staticmethod(config_rules.diloco_errors)

    def __init__(
        self,
        period: int,
        warmup_steps: int,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        model: torch.nn.Module,
        outer_optimizer: DictConfig,
        comm_dtype: str = "float32",
        fragments: int = 1,
        outer_device: str = "device",
    ):
        super().__init__(period, warmup_steps, mesh, traffic, comm_dtype)
        module = model.module if isinstance(model, DistributedDataParallel) else model
        self.outer = OuterState(module, outer_optimizer, outer_device, fragments, self.process_group)

    @property
    def checkpoint_part(self) -> OuterState:
        return self.outer

    def fragment_due(self) -> int | None:
        """The fragment whose sync falls on this step, if any."""
        return schedule.fragment_due(self.step, self.warmup_steps, self.period, len(self.outer.fragments))

    def average_parameters(self, params) -> None:
        """After the local step (`params` are the model's own, which the outer
        state already holds by name, so the argument is not needed)."""
        fragment = self.fragment_due()
        if fragment is not None:
            self.sync(fragment)
        elif schedule.last_synchronous(self.step, self.warmup_steps):  # local training starts after this step
            self.outer.set_from_params(range(len(self.outer.params)))
        self.step += 1

    def sync(self, fragment: int) -> None:
        indices = self.outer.fragments[fragment]
        local = [local_view(self.outer.params[i]) for i in indices]
        device = local[0].device
        synchronize(device)
        start = time.perf_counter()
        nbytes, sums = outer_step(
            local, [self.outer.tensors[i] for i in indices], self.outer.optimizer, self.process_group, self.comm_dtype
        )
        synchronize(device)
        elapsed = time.perf_counter() - start
        dist.all_reduce(sums)  # over every rank: replicas repeat the mean, so divide those sums by the replica count
        replicas = self.process_group.size()
        self.traffic.averaging_bytes = nbytes
        self.traffic.averaged = {
            metrics.AVERAGER_DRIFT: (sums[0] / sums[1].clamp_min(1e-30)).sqrt().item(),
            metrics.AVERAGER_TIME: elapsed,
            metrics.AVERAGER_PSEUDO_GRAD_NORM: (sums[2] / replicas).sqrt().item(),
            metrics.AVERAGER_OUTER_LR: self.outer.optimizer.param_groups[0]["lr"],
            metrics.AVERAGER_FRAGMENT: fragment,
        }


@torch.no_grad()
def outer_step(
    local: list[torch.Tensor],
    outer: list[torch.Tensor],
    outer_optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup,
    comm_dtype: torch.dtype,
) -> tuple[int, torch.Tensor]:
    """One DiLoCo sync of the tensors `local` (this rank's shards) and their
    outer copies `outer` (the optimizer's parameters): average `Δ = outer -
    local` over `group`, step the optimizer with the mean as gradient (only
    these tensors: the others have none), then `local ← outer`.

    Returns the bytes sent and this rank's float64 sums [Σ‖θ_local - mean θ_local‖²,
    Σ‖mean θ_local‖², Σ‖mean Δ‖²], to be summed over ranks for the metrics."""
    device = local[0].device
    nbytes = 0
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for bucket in buckets(local):
        flat_local = torch.cat([local[i].reshape(-1) for i in bucket])
        flat_outer = torch.cat([outer[i].reshape(-1) for i in bucket]).to(device)
        delta = flat_outer - flat_local
        mean = delta.clone()
        nbytes += mean_over_group(mean, group, comm_dtype)
        sums[0] += (delta - mean).square().sum()  # = ||θ_local - mean θ_local||^2
        sums[1] += (flat_outer - mean).square().sum()  # = ||mean θ_local||^2
        sums[2] += mean.square().sum()
        for i, g in zip(bucket, mean.split([local[i].numel() for i in bucket])):
            outer[i].grad = g.view_as(outer[i]).to(outer[i].device)
    outer_optimizer.step()
    outer_optimizer.zero_grad(set_to_none=True)
    torch._foreach_copy_(local, outer)
    return nbytes, sums


class OuterState:
    """θ_outer (one copy of each parameter's local shard, on the device or in
    host memory), the outer optimizer over it, and the plan of `fragments`
    fragments: DiLoCo's checkpoint part (through `CrossReplica`), small state
    in meta.json and tensors in the parameters' layout."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: DictConfig,
        device: str,
        fragments: int,
        group: dist.ProcessGroup,
    ):
        named = list(module.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        param_device = local_view(self.params[0]).device
        self.device = torch.device("cpu") if str(device) == "cpu" else param_device
        self.tensors = [local_view(p).detach().to(self.device, copy=True) for p in self.params]
        self.optimizer = build_optimizer(optimizer, self.tensors, self.device)
        self.fragments, self.group = plan_fragments(module, fragments), group

    @torch.no_grad()
    def set_from_params(self, indices) -> None:
        torch._foreach_copy_([self.tensors[i] for i in indices], [local_view(self.params[i]) for i in indices])

    def state_dict(self) -> dict:
        """Small state, for meta.json: the fragment plan, and which outer
        parameters have optimizer state yet (a fragment gets it at its first sync)."""
        return {
            "fragments": [[self.names[i] for i in fragment] for fragment in self.fragments],
            "outer_state": [self.names[i] for i, t in enumerate(self.tensors) if self.optimizer.state.get(t)],
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("fragments")
        plan = [[self.names[i] for i in fragment] for fragment in self.fragments]
        if saved is not None and saved != plan:
            index = {name: i for i, name in enumerate(self.names)}
            if len(saved) == len(self.fragments) and sorted(sum(saved, [])) == sorted(self.names):
                self.fragments = [[index[name] for name in fragment] for fragment in saved]
            else:
                log.warning("the checkpoint's %d fragments differ from this run's: the new plan applies", len(saved))
        self._create_state([self.names.index(n) for n in state.get("outer_state", [])])

    def tensor_state_dict(self) -> dict:
        """θ_outer and the outer optimizer's state by parameter name, in the
        parameters' layout (DTensors under FSDP2), sharing storage with them."""
        optim_state = {}
        for name, p, t in zip(self.names, self.params, self.tensors):
            state = self.optimizer.state.get(t)
            if state:
                optim_state[name] = {
                    k: _in_layout(v, p) if torch.is_tensor(v) and v.shape == t.shape else v for k, v in state.items()
                }
        return {
            "params": {name: _in_layout(t.detach(), p) for name, p, t in zip(self.names, self.params, self.tensors)},
            "optim_state": optim_state,
        }

    @torch.no_grad()
    def load_tensor_state_dict(self, state: dict | None) -> None:
        """`state`: `tensor_state_dict()`'s tensors, filled by the load. They
        share storage with the outer state on the device; in host memory
        (`outer_device=cpu`) the layout wrappers are device copies (a DTensor
        lives on its mesh's device), so the values are copied back here. None:
        the checkpoint has no outer state (saved by another averager), so
        θ_outer starts as the replicas' mean of the parameters."""
        if state is None:
            self.set_from_params(range(len(self.params)))
            for bucket in buckets(self.tensors):
                flat = torch.cat([self.tensors[i].reshape(-1) for i in bucket]).to(local_view(self.params[0]).device)
                mean_over_group(flat, self.group, flat.dtype)
                torch._foreach_copy_(
                    [self.tensors[i] for i in bucket],
                    [
                        f.view_as(self.tensors[i])
                        for i, f in zip(bucket, flat.split([self.tensors[i].numel() for i in bucket]))
                    ],
                )
            return
        for name, t in zip(self.names, self.tensors):
            t.copy_(local_view(state["params"][name]))
            own = self.optimizer.state[t]
            for key, value in state["optim_state"].get(name, {}).items():
                if torch.is_tensor(own.get(key)) and torch.is_tensor(value):
                    own[key].copy_(local_view(value))
                else:
                    own[key] = value

    def _create_state(self, indices: list[int]) -> None:
        """Give exactly these outer parameters optimizer state, for a load to fill
        in place: a step with zero gradients at lr 0 (what DCP's own
        `_init_optim_state` does, but that one gives state to every parameter)."""
        if not indices or self.optimizer.state:
            return
        for i in indices:
            self.tensors[i].grad = torch.zeros_like(self.tensors[i])
        groups = self.optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)


def _in_layout(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's shard) as a tensor laid out like `param`."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local


def plan_fragments(model: torch.nn.Module, count: int) -> list[list[int]]:
    """`count` fragments of whole units (each block; every other top-level
    module, as the embeddings and the head), balanced by size: largest unit
    first onto the lightest fragment. Returns parameter indices, in model order."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    blocks = list(getattr(model, "blocks", []))
    units = [list(block.parameters()) for block in blocks]
    units += [
        list(child.parameters())
        for name, child in model.named_children()
        if name != "blocks" and any(True for _ in child.parameters())
    ]
    units += [[p] for p in model.parameters(recurse=False)]
    placed: set[int] = set()  # a tied parameter (embedding = head) belongs to its first unit only
    units = [[p for p in unit if id(p) not in placed and not placed.add(id(p))] for unit in units]
    units = [unit for unit in units if unit]
    fragments: list[list[int]] = [[] for _ in range(count)]
    sizes = [0] * count
    for unit in sorted(units, key=lambda u: -sum(p.numel() for p in u)):
        lightest = sizes.index(min(sizes))
        fragments[lightest] += [index[id(p)] for p in unit]
        sizes[lightest] += sum(p.numel() for p in unit)
    return [sorted(f) for f in fragments]
