"""Wiring what crosses replicas (gradient hooks, the averager inside
`PostLocalSGDOptimizer`) and the `cross_replica` checkpoint part: the
cumulative byte count and the averager's own state."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import PostLocalSGDOptimizer

from harness.averaging.averagers import ReplicaAverager
from harness.averaging.gradient_reduction import GradientReduction
from harness.averaging.hooks import count_synchronous_gradients, reduce_over_replicas, sync_gradients_during_warmup
from harness.averaging.link import ReplicaLink
from harness.averaging.traffic import CrossReplicaTraffic
from harness.clock import SYNCHRONOUS, Clock, Schedule


def averaging_schedule(cfg: DictConfig, averaging: bool) -> Schedule:
    """When replicas exchange, for the run's clock: the averager's own reading of `cfg` (= cfg.averager),
    or with no averager (`averaging` false: `RunPlan.averaging`) a gradient exchange at every step."""
    return get_class(cfg._target_).schedule(cfg) if averaging else SYNCHRONOUS


def setup_cross_replica(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh,
    cfg: DictConfig,
    clock: Clock,
    averaging: bool,
    link: ReplicaLink | None = None,
    reduction: GradientReduction | None = None,
) -> tuple[torch.optim.Optimizer, CrossReplica | None]:
    """Wire gradient sync and parameter averaging across replicas for `cfg` (= cfg.averager), at the
    steps `clock` says; `averaging`: the run's plan has an averager (`RunPlan.averaging`), else it is
    synchronous; `link`: the replicas' link when they are not on this mesh (fault tolerance);
    `reduction`: a replica of one device's gradient reduction, else the model's own (FSDP2, DDP).

    Returns the optimizer to step (PostLocalSGDOptimizer when averaging) and
    the object that reports this step's cross-replica figures, or None when
    the layout has a single replica (nothing crosses replicas).
    """
    if link is None and mesh["replicate"].size() < 2:
        return optimizer, None
    traffic = CrossReplicaTraffic()
    if not averaging:
        if link is None:
            count_synchronous_gradients(model, traffic, reduction, mesh)
        else:  # replica groups (fault tolerance): every step's gradients cross the link
            reduce_over_replicas(model, reduction, link, traffic)
        return optimizer, CrossReplica(traffic, None, link=link)
    # partial first: instantiate would merge (and copy) keyword objects into the config;
    # not recursive: nested configs (DiLoCo's outer optimizer) are the averager's to build
    build = instantiate(cfg, _partial_=True, _recursive_=False)
    takes = inspect.signature(build.func).parameters
    # the schedule's keys are the clock's (`averaging_schedule`); DiLoCo takes the model (its own copy of the
    # parameters); the link only under fault tolerance: an averager of one world needs no `link` argument
    own = {key: value for key, value in build.keywords.items() if key in takes}
    extra = {**({"model": model} if "model" in takes else {}), **({"link": link} if link is not None else {})}
    averager = build.func(**own, mesh=mesh, traffic=traffic, clock=clock, **extra)
    sync_gradients_during_warmup(model, mesh, averager, traffic, reduction)
    optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
    return optimizer, CrossReplica(traffic, averager, link)


def step_without_update(optimizer: torch.optim.Optimizer) -> None:
    """A step whose local update is skipped (its loss or gradients were not finite, checked on the host; or,
    under fault tolerance, its gradient exchange did not commit) still counts, as a step a fused optimizer
    skips on the device does (its `found_inf`): what the clock says falls after it (an exchange) happens."""
    if isinstance(optimizer, PostLocalSGDOptimizer):
        optimizer.averager.average_parameters(params=optimizer.param_groups)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The local optimizer: the one inside `PostLocalSGDOptimizer` when averaging, else `optimizer` itself."""
    return optimizer.optim if isinstance(optimizer, PostLocalSGDOptimizer) else optimizer


@dataclass
class CrossReplica:
    traffic: CrossReplicaTraffic
    averager: ReplicaAverager | None
    link: ReplicaLink | None = None  # the replica groups' link (fault tolerance); None: the replicas are this mesh's

    def before_step(self) -> None:
        """Before a step's forward: what the averager does there (DiLoCo: a delayed sync due)."""
        if self.averager is not None:
            self.averager.before_step()

    @property
    def averaged_this_step(self) -> bool:
        """The step just taken averaged (or synced) across replicas; reset by `step_metrics`."""
        return self.traffic.averaged is not None

    def step_metrics(self) -> dict:
        return self.traffic.step_metrics(self.averager.step if self.averager is not None else None)

    def wait(self) -> None:
        """Complete collectives still in flight (a delayed DiLoCo sync), before the process group goes."""
        if self.averager is not None and hasattr(self.averager, "wait"):
            self.averager.wait()

    @property
    def _averager_part(self):
        return self.averager.checkpoint_part if self.averager is not None else None

    def state_dict(self) -> dict:
        part, link = self._averager_part, self.link
        return {
            "cross_replica_bytes_total": self.traffic.total_bytes,
            **({"averager": part.state_dict()} if part is not None else {}),
            # torchft's Manager: its step counts committed exchanges, which decides who heals whom
            **({"replica_link": link.state_dict()} if hasattr(link, "state_dict") else {}),
        }

    def tensor_state_dict(self) -> dict:
        """The averager's own tensors (DiLoCo's outer parameters and state), if any."""
        part = self._averager_part
        return part.tensor_state_dict() if part is not None else {}

    def load_tensor_state_dict(self, state: dict | None) -> None:
        part = self._averager_part
        if part is not None:
            part.load_tensor_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        self.traffic.total_bytes = state.get("cross_replica_bytes_total", 0)
        part = self._averager_part
        if part is not None:
            part.load_state_dict(state.get("averager", {}))
        if hasattr(self.link, "load_state_dict") and "replica_link" in state:
            self.link.load_state_dict(state["replica_link"])
