"""Where a step's time goes.

`StepProfiler` is `train.profile`: torch.profiler on a schedule, a trace per
rank in the run dir (docs/gpu.md#where-a-steps-time-goes).

`DispatchCounter` is the host's side of a step, counted where no GPU is: the
aten ops a piece of code dispatches and the host syncs among them
(`aten._local_scalar_dense`: every `.item()`, `bool()`, `int()` of a device
tensor). On a GPU each op is a kernel launch or more, and each host sync makes
the host wait for the device instead of queueing the next step, so these two
counts on CPU track the overhead a GPU run pays (tests/test_host_syncs.py,
bench/overhead.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity
from torch.utils._python_dispatch import TorchDispatchMode

HOST_SYNC = torch.ops.aten._local_scalar_dense.default


class DispatchCounter(TorchDispatchMode):
    """Counts the ops dispatched on this thread while it is entered (a context
    manager). Ops run by other threads (a data prefetch thread) are theirs."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        return self.ops[HOST_SYNC]


class StepProfiler:
    """`train.profile`: torch.profiler over the steps its schedule picks (skip `wait`
    steps, trace `warmup` steps and drop them, record `active` steps; `repeat`
    cycles, 0 = until the run ends), as torchtitan's profiling section does. Each
    recorded window leaves, per rank, in `<run dir>/profile/`: a trace
    (`rank<N>.<time>.pt.trace.json`, for Perfetto or TensorBoard's profiler) and
    the ops by self device time (`rank<N>_step<S>.txt`), the newest `keep`
    windows' only (a trace is tens of MB: `repeat=0` on a long run would fill a
    disk); with `memory_snapshot` (CUDA), the allocator's history over the first
    window (`rank<N>_memory.pickle`, for pytorch.org/memory_viz), with the Python
    stack of each allocation (C++ stacks take minutes and gigabytes to
    symbolize when the snapshot is written)."""

    def __init__(self, cfg, run_dir: Path, rank: int, device: torch.device):
        self.dir, self.rank, self.device, self.keep = run_dir / "profile", rank, device, cfg.keep
        self.dir.mkdir(parents=True, exist_ok=True)
        self.memory = cfg.memory_snapshot and device.type == "cuda"
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        schedule = torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat)
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._save)
        self.profiler.start()
        self.step_count = 0

    def step(self) -> None:
        """After each training step."""
        self.step_count += 1
        self.profiler.step()

    def stop(self) -> None:
        self.profiler.stop()
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _save(self, profiler: torch.profiler.profile) -> None:
        torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}")(profiler)
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=30)
        (self.dir / f"rank{self.rank}_step{self.step_count}.txt").write_text(table + "\n")
        for pattern in (f"rank{self.rank}.*.pt.trace.json", f"rank{self.rank}_step*.txt"):
            for old in sorted(self.dir.glob(pattern), key=lambda p: (p.stat().st_mtime_ns, p.name))[: -self.keep]:
                old.unlink()
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False
