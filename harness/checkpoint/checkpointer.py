"""Saving on schedule and loading at start, whatever the mode: `Checkpointer`
and `load`. What a checkpoint holds is the model and optimizer (written by the
mode: `full` or `sharded`), every rank's RNG states, and the job's named
stateful parts (`Job.checkpoint_parts`): their small state in meta.json, their
tensors (`tensor_state_dict`) next to the model's under `parts/<name>`; the
mode only decides how the tensors reach the disk."""

from __future__ import annotations

import errno
import logging
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from harness import metrics
from harness.checkpoint.files import RNG_FILE, CheckpointError, commit, read_meta, remove_leftovers, unreadable
from harness.checkpoint.full import FullMode
from harness.checkpoint.meta import FORMAT
from harness.checkpoint.replicas import copy_key, inner_optimizer, load_mean_of_copies, local_tensors, replica_layout
from harness.checkpoint.sharded import AsyncShardedMode, ShardedMode
from harness.clock import Tick
from harness.config import CheckpointConf
from harness.dist import synchronize, true_on_every_rank
from harness.float8 import plain_tensors
from harness.job import Job, Stateful
from harness.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

MODES = {"full": FullMode, "sharded": ShardedMode}


@dataclass
class PendingSave:
    """An async save in flight."""

    staged: Future  # the host copy of the state is complete
    written: Future  # ... and on disk
    partial: Path
    meta: dict
    rngs: list | None  # rank 0: every rank's RNG states, written at commit
    started: float
    staging_wait_s: float = 0.0


class Checkpointer:
    """Saves on schedule (at most one async save in flight).

    Collective: every rank calls `wait_for_staging` before each optimizer step,
    `after_step` after it, and `wait` then `close` at the end. Only rank 0
    writes `meta.json` and `rng.pt`, renames and deletes.
    """

    def __init__(self, cfg: CheckpointConf, root: Path, rank: int, device: torch.device, run_config: dict):
        """`run_config`: the resolved config as plain values, recorded in meta.json."""
        self.cfg, self.root, self.rank, self.device = cfg, root, rank, device
        self.run_config = run_config
        self.mode = (AsyncShardedMode(device) if cfg["async"] else MODES[cfg.mode]()) if cfg.mode != "none" else None
        self.pending: PendingSave | None = None

    @property
    def async_save(self) -> bool:
        return isinstance(self.mode, AsyncShardedMode)

    def due(self, tick: Tick) -> bool:
        """A save falls after `tick` (a meeting of every rank): a multiple of `checkpoint.interval` was reached
        since the meeting before, or the run ends."""
        return self.mode is not None and tick.reached(self.cfg.interval)

    def after_step(self, job: Job, tick: Tick) -> dict:
        """Save if one is due after `tick`; report an async save that finished. Returns metrics for this step."""
        row = self._poll()
        if self.due(tick):
            row.update(self.save(job, tick.step))
        return row

    def save(self, job: Job, step: int) -> dict:
        row = self.wait()  # at most one save in flight
        synchronize(self.device)  # the step's queued work is not the save's time
        start = time.perf_counter()
        partial = self._open_partial(step)
        self._refuse_nonfinite(job, step)
        layout = replica_layout(job)
        parts = job.checkpoint_parts()
        part_tensors = {name: tensors for name, part in parts.items() if (tensors := tensor_state(part))}
        meta = {
            "format": FORMAT,
            "step": step,
            "mode": self.cfg.mode,
            **{name: part.state_dict() for name, part in parts.items()},
            "tensor_parts": sorted(part_tensors),
            "world_size": dist.get_world_size(),
            "replica_copies": layout.replicas if layout.diverged else 1,
            "mesh": dict(zip(job.mesh.mesh_dim_names, job.mesh.shape)),
            "model": self.run_config["model"],
            "optimizer": self.run_config["optimizer"]["_target_"],
            "torch": torch.__version__,
            "config": self.run_config,
        }
        rngs = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(rng_state(), rngs, dst=0)
        model_sd, optim_sd = plain_tensors(get_state_dict(job.model, inner_optimizer(job.optimizer)))
        payload = self.mode.stage(model_sd, optim_sd, plain_tensors(part_tensors), layout)
        synchronize(self.device)
        timings = {metrics.CHECKPOINT_STATE_DICT: time.perf_counter() - start, metrics.CHECKPOINT_MODE: self.cfg.mode}
        if self.async_save:
            staged, written = self.mode.start(payload, partial)
            self.pending = PendingSave(staged, written, partial, meta, rngs, start)
            return {**row, **timings, metrics.CHECKPOINT_SAVE: time.perf_counter() - start}
        with _writing(step, partial):
            self.mode.write(payload, layout, partial)
        dist.barrier()  # every rank's part is on disk
        written = self._commit(partial, meta, rngs)
        save_s = time.perf_counter() - start
        return {
            **row,
            **timings,
            metrics.CHECKPOINT_SAVE: save_s,
            metrics.CHECKPOINT_WRITE: save_s - timings[metrics.CHECKPOINT_STATE_DICT],
            **written,
        }

    def wait_for_staging(self) -> float:
        """Before parameters change: the async save in flight has its own copy of them. Returns the
        seconds waited for it (the save's, not the step's: the run's clock leaves them out of step times)."""
        if self.pending is None or self.pending.staged.done():
            return 0.0
        start = time.perf_counter()
        self.pending.staged.result()
        waited = time.perf_counter() - start
        self.pending.staging_wait_s += waited
        return waited

    def wait(self) -> dict:
        """Block until the save in flight (if any) is durable; its metrics."""
        if self.pending is None:
            return {}
        pending, self.pending = self.pending, None
        with _writing(pending.meta["step"], pending.partial):
            pending.written.result()
        # DCP's coordinator (rank 0) writes .metadata only after every rank's
        # files are written, so when rank 0's future is done the checkpoint is.
        written = self._commit(pending.partial, pending.meta, pending.rngs)
        return {
            metrics.CHECKPOINT_WRITE: time.perf_counter() - pending.started,
            metrics.CHECKPOINT_STAGING_WAIT: pending.staging_wait_s,
            **written,
        }

    def close(self) -> None:
        if self.async_save:
            self.mode.close()

    def _poll(self) -> dict:
        # Only rank 0 commits; every rank collects its own future's outcome so
        # background errors surface. No collective here: ranks finish at different steps.
        if self.pending is not None and self.pending.written.done():
            return self.wait()
        return {}

    def _open_partial(self, step: int) -> Path:
        partial = self.root / f"step_{step}.partial"
        if self.rank == 0:
            remove_leftovers(self.root)
            partial.mkdir(parents=True)
        dist.barrier()
        return partial

    def _refuse_nonfinite(self, job: Job, step: int) -> None:
        tensors = local_tensors(job.model, inner_optimizer(job.optimizer))
        if not true_on_every_rank(torch.stack([torch.isfinite(t).all() for t in tensors]).all()):
            raise CheckpointError(
                f"refusing to save step {step}: parameters or optimizer state hold NaN/inf, and a "
                "checkpoint must never hold them. Fix: lower optimizer.lr or keep train.grad_clip > 0, "
                "and resume from the last checkpoint."
            )

    def _commit(self, partial: Path, meta: dict, rngs: list | None) -> dict:
        if self.rank != 0:
            return {}
        with _writing(meta["step"], partial):
            return {metrics.CHECKPOINT_BYTES: commit(partial, meta, rngs, self.cfg.keep)}


@dataclass
class Loaded:
    """What `load` restored."""

    meta: dict  # the checkpoint's meta.json, in today's format
    row: dict  # its metrics
    models: int  # the different models its replicas' copies held (more than 1: every replica took their mean)


def load(path: Path, job: Job, rank: int, others: tuple[Path, ...] = ()) -> Loaded:
    """Restore model, optimizer, RNG states and the job's stateful parts from the
    checkpoint at `path`; with `others` (a fault-tolerant run's other replica groups'
    checkpoints at its step, resumed in one world) the model and optimizer state are
    their mean. Collective. Raises CheckpointError naming the path when a file is
    missing or damaged."""
    start = time.perf_counter()
    meta = read_meta(path)
    layout = replica_layout(job)
    copies = meta["replica_copies"]
    mode = MODES[meta["mode"]]()
    optim = inner_optimizer(job.optimizer)
    # the run's optimizer settings win over the checkpoint's param groups (the rates: the schedule's, below)
    configured = [
        [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in o.param_groups]
        for o in (optim if isinstance(optim, list) else [optim])
    ]

    def load_copy(copy_key: str | None, source: Path = path, source_mode=mode) -> float:
        with _loading(source):
            return source_mode.load_copy(source, copy_key, job.model, optim)

    models = 1
    if others:  # one rule between replica groups and one world: every replica from the mean of their copies
        sources = (path, *others)
        loaders = [partial(load_copy, None, p, MODES[read_meta(p)["mode"]]()) for p in sources]
        set_s, params_apart, _ = load_mean_of_copies(job, loaders)
        models = len(sources) if params_apart else 1
        if rank == 0:
            log.warning(
                "resuming the %d replica groups' checkpoints at step %d (%s) in one world: every replica starts "
                "from the mean of their models%s",
                len(sources),
                meta["step"],
                ", ".join(str(p) for p in sources),
                "" if params_apart else " (one model: they are equal)",
            )
    elif copies == 1:
        set_s = load_copy(None)
    elif layout.local_sgd and copies == layout.replicas:
        set_s = load_copy(f"replica_{layout.replica}" if layout.replica > 0 else None)
        models = copies
    else:
        loaders = [partial(load_copy, copy_key(replica)) for replica in range(copies)]
        set_s, params_apart, states_apart = load_mean_of_copies(job, loaders)
        models = copies if params_apart else 1
        this_run = f"this run has {layout.replicas}{'' if layout.local_sgd else ' and no averager'}"
        if rank == 0 and params_apart:
            log.warning(
                "checkpoint %s holds %d diverged replicas, %s: every replica starts from their mean",
                path,
                copies,
                this_run,
            )
        elif rank == 0 and states_apart:
            log.warning(
                "checkpoint %s holds %d replicas of one model (each with its own optimizer state), %s: every "
                "replica starts from that model and the mean of their optimizer states",
                path,
                copies,
                this_run,
            )
    for o, groups in zip(optim if isinstance(optim, list) else [optim], configured):
        for group, settings in zip(o.param_groups, groups):
            group.update(settings)
    _restore_rngs(path, rank)
    parts: dict[str, Stateful] = job.checkpoint_parts()
    for name, part in parts.items():
        part.load_state_dict({"step": meta["step"], **meta.get(name, {})})
    # after the small state, which says what the tensors are (e.g. which have optimizer state)
    templates = {name: plain_tensors(tensors) for name, part in parts.items() if (tensors := tensor_state(part))}
    saved = {name: templates[name] for name in meta.get("tensor_parts", []) if name in templates}
    if saved:
        with _loading(path):
            mode.load_parts(path, saved)  # in place
    for name in templates:
        parts[name].load_tensor_state_dict(saved.get(name))
    synchronize(job.data.device)
    row = {metrics.CHECKPOINT_LOAD: time.perf_counter() - start, metrics.CHECKPOINT_SET_STATE_DICT: set_s}
    return Loaded(meta, row, models)


def tensor_state(part: Stateful) -> dict:
    """A part's tensors (in the parameters' layout), or {} for a part that has none."""
    return part.tensor_state_dict() if hasattr(part, "tensor_state_dict") else {}


def _restore_rngs(path: Path, rank: int) -> None:
    try:
        rngs = torch.load(path / RNG_FILE, weights_only=True)
    except Exception as e:
        problem = f"{RNG_FILE} is missing or damaged ({_describe(e)})"
        raise unreadable(path, problem, "Fix: resume from an earlier checkpoint, or checkpoint.resume=never.") from e
    if len(rngs) == dist.get_world_size():
        set_rng_state(rngs[rank])
    elif rank == 0:
        log.warning(
            "checkpoint %s was saved by %d ranks, this run has %d: RNG states not restored",
            path,
            len(rngs),
            dist.get_world_size(),
        )


def _root_cause(e: BaseException) -> BaseException:
    """The first rank's error inside DCP's CheckpointException, else `e`."""
    return next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e


def _describe(e: BaseException) -> str:
    """`Type: first line` of the error (the first rank's, inside DCP's CheckpointException)."""
    cause = _root_cause(e)
    return ": ".join([type(cause).__name__, *str(cause).splitlines()[:1]])[:300]


# torch's zip writer reports a short write (a full disk, a file size limit) in its own words
SHORT_WRITE = ("unexpected pos", "file write failed")
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out")


def _likely_cause(e: BaseException) -> str:
    """What to do about a failed save, naming a cause only where the error itself points at one."""
    cause = _root_cause(e)
    text = str(cause).lower()
    if (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) or any(
        s in text for s in SHORT_WRITE
    ):
        return (
            "Fix: if the disk is full, free space or point checkpoint.dir at a disk with room "
            "(checkpoint/bytes in metrics.jsonl says how much one takes)."
        )
    if isinstance(cause, dist.DistError) or any(s in text for s in PEER_GONE):
        return "Another rank stopped during the save; its log (logs/rank<N>.log) says why. Fix: that rank's error."
    return (
        "The error points at neither a full disk nor a lost rank: its traceback is in train.log "
        "(logs/rank<N>.log for other ranks). Fix: resume from the last checkpoint; if it fails again, report it "
        "with that traceback."
    )


@contextmanager
def _writing(step: int, partial: Path):
    """A failed write as one message with what is known of its cause; the save stays uncommitted."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(
            f"saving checkpoint step {step} to {str(partial)!r} failed ({_describe(e)}); it was not committed and "
            f"earlier checkpoints are untouched. {_likely_cause(e)}"
        ) from e


@contextmanager
def _loading(path: Path):
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        problem = f"loading it failed ({_describe(e)}): it is damaged or does not match this model"
        raise CheckpointError(
            f"checkpoint.resume: loading {str(path)!r} failed ({_describe(e)}). "
            "The checkpoint is damaged or does not match this model. Fix: resume from an earlier checkpoint "
            "(checkpoint.resume=<its step_<N> dir>) or start fresh (checkpoint.resume=never).",
            path,
            problem,
        ) from e
