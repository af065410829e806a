"""Process-group bootstrap: backend and device from what is there, threads, teardown."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

RUN_STAMP_ENV = "HARNESS_RUN_STAMP"  # read by hydra.run.dir / hydra.sweep.dir in conf/config.yaml
_store: dist.Store | None = None  # the rendezvous store, reused by init_distributed


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher setting the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def join_rendezvous() -> None:
    """A torchrun rank connects to the rendezvous store once, before Hydra
    composes; `init_distributed` reuses it, so there is one rendezvous, and no
    process group exists before the config is validated."""
    global _store
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=600)))
    # That store outlives a restart, and so would the previous attempt's
    # process-group keys (gloo would dial dead ranks' addresses): one namespace per attempt.
    _store = dist.PrefixStore(f"harness/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def agree_on_run_stamp() -> None:
    """Make every torchrun rank compose the same Hydra run dir.

    Ranks start seconds apart, so `${now:...}` differs between them. Before
    Hydra composes, rank 0 publishes its timestamp and all ranks export it as
    HARNESS_RUN_STAMP. It is set once, outside the attempt's namespace: workers
    restarted by torchrun (--max-restarts) share the agent's store, so they find
    the first attempt's stamp, land in the same run dir and resume from its
    checkpoints.
    """
    store = _store.underlying_store
    key = "harness/run_stamp"
    if int(os.environ["RANK"]) == 0:
        store.compare_set(key, "", time.strftime("%Y-%m-%d/%H-%M-%S"))
    os.environ[RUN_STAMP_ENV] = store.get(key).decode()


def print_once(message: str, rank: int) -> None:
    """Rank 0 prints `message` (to stderr); under torchrun the other ranks wait
    until it has, before they go on to exit: a rank that exits first makes
    torchrun stop rank 0, possibly before it printed."""
    key = "harness/printed"
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
        if _store is not None:
            _store.set(key, "1")
    elif _store is not None:
        try:
            _store.wait([key], datetime.timedelta(seconds=60))
        except dist.DistError:  # rank 0 is gone without printing: nothing to wait for
            pass


def visible_gpus() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies), counted
    through NVML so that CUDA is never initialised here: the process that
    validates a config and forks ranks must stay able to fork ranks that use
    CUDA. PYTORCH_NVML_BASED_CUDA_CHECK=1 is PyTorch's documented switch for
    that in `torch.cuda.is_available`; `device_count` asks NVML first anyway."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str, gpus: int) -> str:
    """`train.device` as the device type ranks use: `auto` is cuda when a GPU is visible."""
    return "cuda" if name == "cuda" or (name == "auto" and gpus > 0) else "cpu"


def init_distributed(device_name: str, timeout_s: int, threads_per_rank: int | None) -> DistEnv:
    """Join (or, alone, create) the default process group: nccl on cuda, gloo on cpu."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cuda = resolve_device(device_name, visible_gpus()) == "cuda"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(threads_per_rank or max(1, cores // local_world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if use_cuda else "gloo"
    if _store is not None:
        dist.init_process_group(backend, store=_store, rank=rank, world_size=world_size, timeout=timeout)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:  # a plain single process: a 1-rank group keeps one code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def node_of_each_rank() -> list[int]:
    """Every rank's node, in rank order: torchrun's GROUP_RANK (one agent per node; 0 when launched locally)."""
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)))
    return nodes


def true_on_every_rank(flag: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether a local boolean holds on every rank (of `group`; default all), one 1-element
    all-reduce, so all ranks take the same branch and no rank waits alone in a collective."""
    agreed = flag.to(torch.int32).reshape(1)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (a view: in-place writes land in `t`), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read next measures finished work, not kernel launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (gloo has no AVG, so SUM / world)."""
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
