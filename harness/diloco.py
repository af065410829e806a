"""DiLoCo (arXiv 2311.08105) and Streaming DiLoCo's fragments (arXiv 2501.18512)
on the same schedule, mesh and local shards as `ReplicaAverager`.

Every rank keeps an *outer* copy of its local shards, `θ_outer`, equal on every
replica. At a sync, after the local step, each rank forms the pseudo-gradient
`Δ = θ_outer - θ_local`, averages it over the replicate group, takes one step
of the outer optimizer (any `torch.optim` class; DiLoCo's is Nesterov SGD,
lr 0.7, momentum 0.9) with `Δ` as the gradient, and sets `θ_local ← θ_outer`.
With outer SGD at lr 1 and no momentum this is post-local SGD's average.

With `fragments=F` the model is split into F fragments of whole blocks
(embeddings, final norm and head count as units too), balanced by size;
fragment f syncs at offset f*period/F inside each period, so every fragment
syncs once per period and a sync step sends about 1/F of the model.

`θ_outer` starts as the parameters at the end of warmup (the initial ones when
there is none). The outer optimizer steps plain tensors (the local shards), so
an element-wise optimizer (SGD, Adam, ...) behaves exactly as on whole tensors;
a checkpoint sees them in the parameters' layout (`tensor_state_dict`), so
they reshard with the model.
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
from harness.averaging import CrossReplicaTraffic, ReplicaAverager, buckets, mean_over_group
from harness.dist import local_view, synchronize
from harness.optim import build_optimizer

log = logging.getLogger(__name__)


class DiLoCoAverager(ReplicaAverager):
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
        named = list(module.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        device = local_view(self.params[0]).device
        self.outer_device = torch.device("cpu") if str(outer_device) == "cpu" else device
        self.outer = [local_view(p).detach().to(self.outer_device, copy=True) for p in self.params]
        self.outer_optimizer = build_optimizer(outer_optimizer, self.outer, self.outer_device)
        self.fragments = plan_fragments(module, fragments)

    @staticmethod
    def config_errors(cfg: DictConfig, replicas: int) -> list[str]:
        from harness.models import build_model
        from harness.optim import HARNESS_KEYS
        from harness.components import target_class

        avg = cfg.averager
        errors = ReplicaAverager.config_errors(cfg, replicas)
        outer = avg.outer_optimizer
        if outer is None:
            errors.append(
                "averager.outer_optimizer is not set. Fix: averager/outer_optimizer=nesterov (DiLoCo's Nesterov SGD)."
            )
        else:
            errors += target_class(
                outer,
                "averager.outer_optimizer",
                torch.optim.Optimizer,
                "torch.optim.Optimizer",
                ("params",),
                "nesterov|adamw",
                HARNESS_KEYS,
            )[1]
            if outer.get("in_backward"):
                errors.append(
                    "averager.outer_optimizer.in_backward=true: the outer optimizer steps at syncs, not in "
                    "backward. Fix: averager.outer_optimizer.in_backward=false (optimizer.in_backward is the "
                    "local optimizer's)."
                )
            lr = outer.get("lr")
            if not isinstance(lr, (int, float)) or lr <= 0:
                errors.append(
                    f"averager.outer_optimizer.lr={lr!r} must be a positive number. "
                    "Fix: averager.outer_optimizer.lr=0.7 (DiLoCo's)."
                )
        f = avg.fragments
        if f < 1:
            errors.append(f"averager.fragments={f} is out of range: it must be >= 1. Fix: averager.fragments=1.")
        elif avg.period >= 1 and avg.period % f:
            divisors = [d for d in range(1, avg.period + 1) if avg.period % d == 0]
            errors.append(
                f"averager.fragments={f} does not divide averager.period={avg.period}: fragments sync at offsets "
                f"period/fragments apart. Fix: averager.fragments in {divisors}, or a period that is a multiple of {f}."
            )
        else:
            try:
                blocks = len(getattr(build_model(cfg.model, cfg.train.seq_len), "blocks", []))
            except ValueError:
                return errors  # the model's own error is reported by validate
            if f > max(blocks, 1):
                errors.append(
                    f"averager.fragments={f} exceeds the model's {blocks} blocks; a fragment is whole blocks. "
                    f"Fix: averager.fragments={max(d for d in range(1, max(blocks, 1) + 1) if avg.period % d == 0)}."
                )
        return errors

    def fragment_due(self) -> int | None:
        """The fragment whose sync falls on this step, if any."""
        if self.step < self.warmup_steps:
            return None
        offset = (self.step - self.warmup_steps) % self.period
        stride = self.period // len(self.fragments)
        return offset // stride if offset % stride == 0 else None

    def average_parameters(self, params) -> None:
        """After the local step (`params` are the model's own, which this averager
        already holds by name, so the argument is not needed)."""
        fragment = self.fragment_due()
        if fragment is not None:
            self.sync(fragment)
        elif self.step == self.warmup_steps - 1:  # the last synchronous step: local training starts here
            self.set_outer(range(len(self.params)))
        self.step += 1

    @torch.no_grad()
    def set_outer(self, indices) -> None:
        torch._foreach_copy_([self.outer[i] for i in indices], [local_view(self.params[i]) for i in indices])

    @torch.no_grad()
    def sync(self, fragment: int) -> None:
        indices = self.fragments[fragment]
        local = [local_view(self.params[i]) for i in indices]
        outer = [self.outer[i] for i in indices]
        device = local[0].device
        synchronize(device)
        start, nbytes = time.perf_counter(), 0
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # [sum dev^2, sum mean^2, sum pseudo-grad^2]
        for bucket in buckets(local):
            flat_local = torch.cat([local[i].reshape(-1) for i in bucket])
            flat_outer = torch.cat([outer[i].reshape(-1) for i in bucket]).to(device)
            delta = flat_outer - flat_local
            mean = delta.clone()
            nbytes += mean_over_group(mean, self.process_group, self.comm_dtype)
            sums[0] += (delta - mean).square().sum()  # = ||θ_local - mean θ_local||^2
            sums[1] += (flat_outer - mean).square().sum()  # = ||mean θ_local||^2
            sums[2] += mean.square().sum()
            for i, g in zip(bucket, mean.split([local[i].numel() for i in bucket])):
                outer[i].grad = g.view_as(outer[i]).to(self.outer_device)
        self.outer_optimizer.step()  # steps only this fragment: the others have no gradient
        self.outer_optimizer.zero_grad(set_to_none=True)
        torch._foreach_copy_(local, outer)
        synchronize(device)
        elapsed = time.perf_counter() - start
        dist.all_reduce(sums)  # over every rank: replicas repeat the mean, so divide those sums by the replica count
        replicas = self.process_group.size()
        self.traffic.averaging_bytes = nbytes
        self.traffic.averaged = {
            metrics.AVERAGER_DRIFT: (sums[0] / sums[1].clamp_min(1e-30)).sqrt().item(),
            metrics.AVERAGER_TIME: elapsed,
            metrics.AVERAGER_PSEUDO_GRAD_NORM: (sums[2] / replicas).sqrt().item(),
            metrics.AVERAGER_OUTER_LR: self.outer_optimizer.param_groups[0]["lr"],
            metrics.AVERAGER_FRAGMENT: fragment,
        }

    # -- checkpoint part (through CrossReplica) ------------------------------------

    def state_dict(self) -> dict:
        """Small state, for meta.json: the fragment plan, and which outer
        parameters have optimizer state yet (a fragment gets it at its first sync)."""
        return {
            "fragments": [[self.names[i] for i in fragment] for fragment in self.fragments],
            "outer_state": [self.names[i] for i, t in enumerate(self.outer) if self.outer_optimizer.state.get(t)],
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
        for name, p, t in zip(self.names, self.params, self.outer):
            state = self.outer_optimizer.state.get(t)
            if state:
                optim_state[name] = {
                    k: _in_layout(v, p) if torch.is_tensor(v) and v.shape == t.shape else v for k, v in state.items()
                }
        return {
            "params": {name: _in_layout(t.detach(), p) for name, p, t in zip(self.names, self.params, self.outer)},
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
            self.set_outer(range(len(self.params)))
            for bucket in buckets(self.outer):
                flat = torch.cat([self.outer[i].reshape(-1) for i in bucket]).to(local_view(self.params[0]).device)
                mean_over_group(flat, self.process_group, flat.dtype)
                torch._foreach_copy_(
                    [self.outer[i] for i in bucket],
                    [
                        f.view_as(self.outer[i])
                        for i, f in zip(bucket, flat.split([self.outer[i].numel() for i in bucket]))
                    ],
                )
            return
        for name, t in zip(self.names, self.outer):
            t.copy_(local_view(state["params"][name]))
            own = self.outer_optimizer.state[t]
            for key, value in state["optim_state"].get(name, {}).items():
                if torch.is_tensor(own.get(key)) and torch.is_tensor(value):
                    own[key].copy_(local_view(value))
                else:
                    own[key] = value

    def _create_state(self, indices: list[int]) -> None:
        """Give exactly these outer parameters optimizer state, for a load to fill
        in place: a step with zero gradients at lr 0 (what DCP's own
        `_init_optim_state` does, but that one gives state to every parameter)."""
        if not indices or self.outer_optimizer.state:
            return
        for i in indices:
            self.outer[i].grad = torch.zeros_like(self.outer[i])
        groups = self.outer_optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = 0.0
        self.outer_optimizer.step()
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        self.outer_optimizer.zero_grad(set_to_none=True)


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
    fragments: list[list[int]] = [[] for _ in range(count)]
    sizes = [0] * count
    for unit in sorted(units, key=lambda u: -sum(p.numel() for p in u)):
        lightest = sizes.index(min(sizes))
        fragments[lightest] += [index[id(p)] for p in unit]
        sizes[lightest] += sum(p.numel() for p in unit)
    return [sorted(f) for f in fragments]
