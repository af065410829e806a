"""DiLoCo (arXiv 2311.08105) and Streaming DiLoCo's fragments (arXiv 2501.18512)
on the same schedule, mesh and local shards as `ReplicaAverager`.

Every rank keeps an *outer* copy of its local shards, `θ_outer`, equal on every
replica. At a sync, after the local step, each rank forms the pseudo-gradient
`Δ = θ_outer - θ_local`, averages it over the replicate group, takes one step
of the outer optimizer (any `torch.optim` class; the paper's is Nesterov SGD,
lr 0.7, momentum 0.9, the default here plain SGD at lr 0.85: docs/diloco.md)
with `Δ` as the gradient, and sets `θ_local ← θ_outer`.
With outer SGD at lr 1 and no momentum this is post-local SGD's average.

Syncs come after `period` local steps (the paper's Algorithm 1 and torchft's
`DiLoCo`: after steps W + P, W + 2P, ... for warmup W), not after the first
local step as torch's `PeriodicModelAverager` (`averager=periodic`) does. With
`fragments=F` the model is split into F fragments of whole blocks (embeddings,
final norm and head count as units too), balanced by size; a sync falls every
P/F local steps, the fragments in turn, so fragment f first syncs after
(f+1)·P/F local steps and then every P, and a sync step sends about 1/F of the
model (`DiLoCoAverager.schedule`, which the run's clock plans from).

`θ_outer` starts as the parameters at the end of warmup (the initial ones when
there is none). The outer optimizer steps plain tensors (the local shards), so
an element-wise optimizer (SGD, Adam, ...) behaves exactly as on whole tensors;
a checkpoint sees them in the parameters' layout (`OuterState`), so they
reshard with the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from harness import metrics
from harness.averaging import config_rules
from harness.averaging.averagers import ReplicaAverager, pace_keys
from harness.averaging.collectives import MeanInFlight, buckets, mean_over_group, start_mean_over_group
from harness.averaging.link import ReplicaLink
from harness.averaging.traffic import CrossReplicaTraffic
from harness.clock import Clock, Exchange, Schedule
from harness.dist import local_view, synchronize
from harness.optim import build_optimizer

log = logging.getLogger(__name__)


class DiLoCoAverager(ReplicaAverager):
    """Runs a fragment's sync where the clock says (`outer_step`), and reports it;
    the outer state it keeps is its checkpoint part."""

    config_errors = staticmethod(config_rules.diloco_errors)

    def __init__(
        self,
        mesh: DeviceMesh,
        traffic: CrossReplicaTraffic,
        clock: Clock,
        model: torch.nn.Module,
        outer_optimizer: DictConfig,
        comm_dtype: str = "float32",
        fragments: int = 1,
        outer_device: str = "device",
        mix: float = 0.0,
        link: ReplicaLink | None = None,
    ):
        super().__init__(mesh, traffic, clock, comm_dtype, link)
        module = model.module if isinstance(model, DistributedDataParallel) else model
        self.outer = OuterState(module, outer_optimizer, outer_device, fragments, self.link)
        self.mix, self.delayed = mix, clock.schedule.sync_delay > 0
        # when periods may change, a delayed sync is applied at each replica's own step: its fragment, time and
        # metric sums wait for the next exchange, where every rank meets, to be summed and reported
        self.unreported: tuple[int, float, torch.Tensor] | None = None
        self.failed_sync: SyncInFlight | None = None  # this step's sync that did not commit, to redo

    @classmethod
    def schedule(cls, cfg: DictConfig) -> Schedule:
        """A sync every period/fragments local steps, the fragments in turn, the first after a whole stride
        (the paper's Algorithm 1, torchft's `DiLoCo`), each applied `sync_delay` local steps after it starts."""
        period = config_rules.period_of(cfg)[1]  # under period=auto: the longest
        return Schedule(
            warmup=cfg.warmup_steps,
            period=period,
            first=period // cfg.fragments,
            fragments=cfg.fragments,
            sync_delay=cfg.sync_delay,
            **pace_keys(cfg),
        )

    @property
    def checkpoint_part(self) -> OuterState:
        return self.outer

    def before_step(self) -> None:
        """Before the run's first local step θ_outer is set from the parameters the warmup left (also where a
        resume lowered `warmup_steps` past the checkpoint's step, whose run had not ended its warmup). A sync
        in flight whose delay is 0 (a replica planned fewer steps than `sync_delay` applies before its next
        step: it loses none of them, and at the exchange, where saves fall, every replica holds the sync just
        started) or was cut short (a resume that lowered the delay, to 0 included) is applied before the
        step's forward."""
        super().before_step()
        tick = self.clock.tick
        if tick.starts_alone:
            self.outer.set_from_params(range(len(self.outer.params)))
        if tick.apply_before and self.outer.in_flight is not None:
            self.apply_delayed()

    def apply_delayed(self) -> None:
        fragments = self.outer.in_flight.fragments
        if self.finish_sync(at_own_step=self.delayed, held_up=True):
            for fragment in fragments:
                self.clock.applied(fragment, delayed=True)

    def average_parameters(self, params) -> None:
        """After the local step (`params` are the model's own, which the outer
        state already holds by name, so the argument is not needed): apply the
        sync whose delay ends here (or, halfway through the delay, start its
        second collective), start the one that falls here (applied at once
        without `sync_delay`, and at the run's last step, where every fragment
        syncs: the run ends with one model)."""
        tick, in_flight = self.clock.tick, self.outer.in_flight
        if tick.apply_after and in_flight is not None:
            self.apply_delayed()
        elif tick.advance and in_flight is not None:
            start = time.perf_counter()
            in_flight.advance()  # halfway: a narrow dtype's all-gather goes under the rest of the window
            in_flight.blocked_s += time.perf_counter() - start
            self.clock.held_up(time.perf_counter() - start)
        if tick.exchange is not None:
            delayed = self.delayed and not tick.last
            scales = self.exchange().scales
            committed = True
            if scales:  # at the last step, none where every fragment is one model already
                self.start_sync(tick.exchange, scales)
                committed = delayed or self.finish_sync()
            self.clock.exchanged(committed)
            if committed and not delayed:
                for fragment in scales:
                    self.clock.applied(fragment)
            if committed:
                self.report_plan()

    def exchange(self) -> Exchange:
        """The clock's exchange at this step; a delayed sync applied since the last one is summed over
        every rank on it and reported on this step's row."""
        carried = None
        if self.delayed and self.clock.plans:  # every rank sends the slots, so that all send the same figures
            # the sums are the outer step's, on this stream: the clock synchronizes before it reads them
            carried = self.unreported[2] if self.unreported is not None else torch.zeros(3, dtype=torch.float64)
        exchange = self.clock.exchange(carried, skip_untrained=self.mix == 0)
        if self.unreported is not None:
            fragment, time_s, _ = self.unreported
            self.report(fragment, time_s, exchange.carried)
            self.unreported = None
        return exchange

    def start_sync(self, fragment: int, scales: dict[int, float | None]) -> None:
        """Form the pseudo-gradients of the fragments in `scales` (the tick's `fragment`; at the run's last step
        every fragment) and start averaging them across replicas in one sync, each fragment's scaled by its
        scale first when given (a weighted mean: `Clock.exchange`); their bytes count on the next logged row."""
        start = time.perf_counter()
        self.outer.start_sync(fragment, scales, self.link, self.comm_dtype)
        self.outer.in_flight.blocked_s = time.perf_counter() - start
        self.traffic.add_averaging(sum(c.nbytes for c in self.outer.in_flight.collectives))

    def finish_sync(self, sync: SyncInFlight | None = None, at_own_step: bool = False, held_up: bool = False) -> bool:
        """Wait for the fragment's mean pseudo-gradient (of the sync in flight, or `sync`), take
        the outer step, set the fragment's parameters, and report the sync on this step's row (or,
        `at_own_step`, a delayed sync applied at this replica's own step where periods may change:
        on the next exchange's). `held_up`: applied inside a period, where the time it holds training up
        is the clock's (`Clock.held_up`). False when it did not commit (fault tolerance): dropped, θ_outer
        unchanged."""
        if sync is None:
            sync, self.outer.in_flight = self.outer.in_flight, None
        device = self.outer.tensors[0].device
        synchronize(device)  # the step's own kernels first (CUDA): what follows is the sync's wait and outer step
        start = time.perf_counter()
        sums = self.outer.finish_sync(sync, self.mix)
        if sums is not None:
            synchronize(device)
        if held_up:  # what the delay did not hide
            self.clock.held_up(time.perf_counter() - start)
        if sums is None:
            self.uncommitted, self.failed_sync = True, sync
            return False
        if self.clock.plans and at_own_step:  # see `unreported`
            self.unreported = (sync.fragment, sync.blocked_s + time.perf_counter() - start, sums)
            return True
        dist.all_reduce(sums)  # over every rank: replicas repeat the mean, so divide those sums by the replica count
        self.link.sum_over_replicas(sums)
        self.report(sync.fragment, sync.blocked_s + time.perf_counter() - start, sums)
        return True

    def report(self, fragment: int, time_s: float, sums: torch.Tensor) -> None:
        """A sync's row: its fragment, the time it held training up, and its metric sums over every rank."""
        replicas = self.link.size()
        self.traffic.averaged = {
            metrics.AVERAGER_TIME: time_s,
            metrics.AVERAGER_PSEUDO_GRAD_NORM: (sums[2] / replicas).sqrt().item(),
            metrics.AVERAGER_OUTER_LR: self.outer.optimizer.param_groups[0]["lr"],
            metrics.AVERAGER_FRAGMENT: fragment,
        }
        if sums[0] >= 0:  # negative: the pseudo-gradients of a resumed window are gone, so is the drift
            self.traffic.averaged[metrics.AVERAGER_DRIFT] = (sums[0] / sums[1].clamp_min(1e-30)).sqrt().item()

    def redo_exchange(self) -> None:
        """This step's sync, which did not commit, started again over the link's quorum as it is now,
        weighed over the replicas in it, and finished."""
        sync, self.failed_sync, self.uncommitted = self.failed_sync, None, False
        again = self.outer.restart_sync(sync, self.link, self.comm_dtype, self.clock.reweigh(sync.fragments))
        self.traffic.add_averaging(sum(c.nbytes for c in again.collectives))
        if self.finish_sync(again):
            for fragment in sync.fragments:
                self.clock.applied(fragment)

    def wait(self) -> None:
        """Complete a sync's collectives still in flight (before the process group goes)."""
        if self.outer.in_flight is not None:
            self.outer.in_flight.wait()


@dataclass
class SyncInFlight:
    """A fragment's sync between its start and the step its outer step is applied
    after (`sync_delay` later): the fragment's pseudo-gradients `deltas` and their
    mean over the replicas `means` (per parameter, local shards; the mean is
    complete once `wait()` has returned). At the run's last step one sync holds
    every fragment, applied at once."""

    fragment: int  # the fragment whose turn it is (logged)
    fragments: list[int]  # the fragments it syncs: `fragment`, or at the run's last step every one
    indices: list[int]  # their parameters, in model order
    deltas: list[torch.Tensor] | None  # None after a resume: only the mean was saved
    means: list[torch.Tensor]
    collectives: list[MeanInFlight]  # empty after a resume: the mean was saved complete
    blocked_s: float = 0.0  # time the start (and the halfway advance) held up training

    def advance(self) -> None:
        for collective in self.collectives:
            collective.advance()

    def wait(self) -> None:
        if self.collectives:
            for collective in self.collectives:
                collective.wait()
            self.collectives = []
            # storage of their own, not views of the flat buckets: a checkpoint stages them by storage
            self.means = [m.clone() for m in self.means]


@torch.no_grad()
def outer_step(
    local: list[torch.Tensor],
    outer: list[torch.Tensor],
    outer_optimizer: torch.optim.Optimizer,
    group: ReplicaLink | dist.ProcessGroup,
    comm_dtype: torch.dtype,
) -> tuple[int, torch.Tensor]:
    """One DiLoCo sync of the tensors `local` (this rank's shards) and their
    outer copies `outer` (the optimizer's parameters): average `Δ = outer -
    local` over `group`, step the optimizer with the mean as gradient (only
    these tensors: the others have none), then `local ← outer`.

    Returns the bytes sent and this rank's float64 sums [Σ‖θ_local - mean θ_local‖²,
    Σ‖mean θ_local‖², Σ‖mean Δ‖²], to be summed over ranks for the metrics."""
    deltas, means, collectives = start_pseudo_gradient_mean(local, outer, group, comm_dtype)
    for collective in collectives:
        collective.wait()
    return sum(c.nbytes for c in collectives), apply_outer_step(local, outer, outer_optimizer, deltas, means, 0.0)


@torch.no_grad()
def start_pseudo_gradient_mean(
    local: list[torch.Tensor],
    outer: list[torch.Tensor],
    group: ReplicaLink | dist.ProcessGroup,
    comm_dtype: torch.dtype,
    scales: list[float | None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[MeanInFlight]]:
    """`Δ = outer - local` per tensor, and its mean over `group` started (`start_means`; of
    each Δ times its scale where `scales` gives one). Returns (Δ, mean, collectives)."""
    deltas = torch._foreach_sub([o.to(t.device) for o, t in zip(outer, local)], local)
    return (deltas, *start_means(deltas, group, comm_dtype, scales))


@torch.no_grad()
def start_means(
    tensors: list[torch.Tensor],
    group: ReplicaLink | dist.ProcessGroup,
    comm_dtype: torch.dtype,
    scales: list[float | None] | None = None,
) -> tuple[list[torch.Tensor], list[MeanInFlight]]:
    """The mean of each of `tensors` (times its scale, where `scales` gives one) over `group`,
    started, one bucket per collective. Returns (mean, collectives): per-tensor views of the
    flat buckets, complete once every collective's `wait()` returned."""
    means, collectives = [], []
    for bucket in buckets(tensors):
        flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
        sizes = [tensors[i].numel() for i in bucket]
        parts = flat.split(sizes)
        for i, part in zip(bucket, parts):
            if scales is not None and scales[i] is not None:
                part.mul_(scales[i])
        collectives.append(start_mean_over_group(flat, group, comm_dtype))
        means += [m.view_as(tensors[i]) for i, m in zip(bucket, parts)]
    return means, collectives


@torch.no_grad()
def apply_outer_step(
    local: list[torch.Tensor],
    outer: list[torch.Tensor],
    outer_optimizer: torch.optim.Optimizer,
    deltas: list[torch.Tensor] | None,
    means: list[torch.Tensor],
    mix: float,
) -> torch.Tensor:
    """Step the outer optimizer with the mean pseudo-gradients `means` as gradients,
    then set `local` to the new `outer`, or with `mix` > 0 to `outer + mix·(local
    - outer)` (torchft's fragment_update_alpha). Returns the metrics' float64 sums
    (see `outer_step`); the first is -1 without `deltas`."""
    sums = torch.zeros(3, dtype=torch.float64, device=local[0].device)
    for o, m in zip(outer, means):
        sums[1] += (o.to(m.device) - m).square().sum()  # = ||mean θ_local||^2
        sums[2] += m.square().sum()
    if deltas is None:
        sums[0] = -1.0
    else:
        for d, m in zip(deltas, means):
            sums[0] += (d - m).square().sum()  # = ||θ_local - mean θ_local||^2
    for o, m in zip(outer, means):
        o.grad = m.to(o.device)
    outer_optimizer.step()
    outer_optimizer.zero_grad(set_to_none=True)
    if mix == 0.0:
        torch._foreach_copy_(local, outer)
    else:
        mixed = [o.to(t.device, copy=True) for o, t in zip(outer, local)]
        torch._foreach_lerp_(mixed, local, mix)
        torch._foreach_copy_(local, mixed)
    return sums


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
        link: ReplicaLink,
    ):
        named = list(module.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        param_device = local_view(self.params[0]).device
        self.device = torch.device("cpu") if str(device) == "cpu" else param_device
        self.tensors = [local_view(p).detach().to(self.device, copy=True) for p in self.params]
        self.optimizer = build_optimizer(optimizer, self.tensors, self.device)
        self.fragments, self.link = plan_fragments(module, fragments), link
        self.in_flight: SyncInFlight | None = None

    def start_sync(
        self, fragment: int, scales: dict[int, float | None], group: ReplicaLink, comm_dtype: torch.dtype
    ) -> None:
        """The sync of the fragments in `scales` (each with its scale), `fragment`'s turn."""
        scale_of = {i: scale for f, scale in scales.items() for i in self.fragments[f]}
        indices = sorted(scale_of)
        local = [local_view(self.params[i]) for i in indices]
        deltas, means, collectives = start_pseudo_gradient_mean(
            local, [self.tensors[i] for i in indices], group, comm_dtype, [scale_of[i] for i in indices]
        )
        self.in_flight = SyncInFlight(fragment, sorted(scales), indices, deltas, means, collectives)

    def finish_sync(self, sync: SyncInFlight, mix: float) -> torch.Tensor | None:
        """Apply `sync`; returns the metric sums (`apply_outer_step`), or None when the
        link did not commit it (fault tolerance: a replica was lost on the way). A sync
        resumed from a checkpoint (its mean saved complete: no `deltas`) is not voted on
        again: the run that saved it averaged it, and this process may not have opened a
        quorum yet (a replica group joins at its first step that crosses replicas)."""
        sync.wait()
        if sync.deltas is not None and not self.link.commit():
            return None
        local = [local_view(self.params[i]) for i in sync.indices]
        outer = [self.tensors[i] for i in sync.indices]
        return apply_outer_step(local, outer, self.optimizer, sync.deltas, sync.means, mix)

    def restart_sync(
        self, sync: SyncInFlight, group: ReplicaLink, comm_dtype: torch.dtype, scales: dict[int, float | None]
    ) -> SyncInFlight:
        """`sync`, whose exchange did not commit, started again over `group`: the same pseudo-gradients
        averaged anew, each fragment's scaled by its scale in `scales` (a resumed sync's mean was saved
        complete, and needs no collective)."""
        if sync.deltas is None:
            return sync
        scale_of = {i: scales[f] for f in sync.fragments for i in self.fragments[f]}
        means, collectives = start_means(sync.deltas, group, comm_dtype, [scale_of[i] for i in sync.indices])
        return SyncInFlight(sync.fragment, sync.fragments, sync.indices, sync.deltas, means, collectives)

    @torch.no_grad()
    def set_from_params(self, indices) -> None:
        torch._foreach_copy_([self.tensors[i] for i in indices], [local_view(self.params[i]) for i in indices])

    def state_dict(self) -> dict:
        """Small state, for meta.json: the fragment plan, which outer parameters
        have optimizer state yet (a fragment gets it at its first sync), and the
        sync in its delay window, if any (its mean is among the tensors)."""
        state = {
            "fragments": [[self.names[i] for i in fragment] for fragment in self.fragments],
            "outer_state": [self.names[i] for i, t in enumerate(self.tensors) if self.optimizer.state.get(t)],
        }
        if (sync := self._in_flight_to_save()) is not None:
            state["in_flight"] = {"fragment": sync.fragment}
        return state

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
        self.in_flight = None
        if "in_flight" in state:  # a buffer per parameter for the saved mean, which the tensor load fills
            fragment, indices = state["in_flight"]["fragment"], self.fragments[state["in_flight"]["fragment"]]
            means = [torch.zeros_like(local_view(self.params[i])) for i in indices]
            self.in_flight = SyncInFlight(fragment, [fragment], indices, None, means, [])

    def tensor_state_dict(self) -> dict:
        """θ_outer and the outer optimizer's state by parameter name, in the
        parameters' layout (DTensors under FSDP2), sharing storage with them."""
        optim_state = {}
        sync = self._in_flight_to_save()
        for name, p, t in zip(self.names, self.params, self.tensors):
            state = self.optimizer.state.get(t)
            if state:
                optim_state[name] = {
                    k: _in_layout(v, p) if torch.is_tensor(v) and v.shape == t.shape else v for k, v in state.items()
                }
        state = {
            "params": {name: _in_layout(t.detach(), p) for name, p, t in zip(self.names, self.params, self.tensors)},
            "optim_state": optim_state,
        }
        if sync is not None:
            names = [self.names[i] for i in sync.indices]
            params = [self.params[i] for i in sync.indices]
            state["in_flight_mean"] = {n: _in_layout(m, p) for n, p, m in zip(names, params, sync.means)}
        return state

    def _in_flight_to_save(self) -> SyncInFlight | None:
        """The sync in its delay window, completed, as a checkpoint holds it; None when its exchange
        failed (fault tolerance): its mean is then this replica's own, and a resume drops the sync,
        as this run does when it comes due."""
        if self.in_flight is None:
            return None
        self.in_flight.wait()
        return None if self.link.failed() else self.in_flight

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
                mean_over_group(flat, self.link, flat.dtype)
                torch._foreach_copy_(
                    [self.tensors[i] for i in bucket],
                    [
                        f.view_as(self.tensors[i])
                        for i, f in zip(bucket, flat.split([self.tensors[i].numel() for i in bucket]))
                    ],
                )
            return
        if self.in_flight is not None:
            for i, mean in zip(self.in_flight.indices, self.in_flight.means):
                mean.copy_(local_view(state["in_flight_mean"][self.names[i]]))
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
