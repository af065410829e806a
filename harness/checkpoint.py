"""Checkpoints: save, find and load; `checkpoint=full` or `sharded` (+ `async`).

One checkpoint is a directory `<checkpoint.dir>/step_<N>/`:

    meta.json       step, averager step, data position, layout, replica copies,
                    model config, the resolved config, byte count
    rng.pt          every rank's RNG states, a list indexed by global rank
    full mode:      full.pt - {"model": FQN -> tensor, "optim": FQN-keyed state},
                    plain tensors, loadable with torch.load(weights_only=True)
    sharded mode:   a DCP directory (.metadata + one file per rank)

Atomicity: every file is written under `step_<N>.partial/`; rank 0 writes
`meta.json` once every rank's part is on disk, and then renames the directory
to `step_<N>/`. Only renamed directories with a `meta.json` count, so a save
killed halfway never hides or damages the previous checkpoint, and the next
save deletes the leftover `.partial` directory.

Diverged replicas (post-local SGD past warmup): between averaging steps every
replica holds its own parameters and optimizer state. DCP deduplicates equal
keys across ranks and would keep one replica's copy, so each replica saves its
own copy: replica 0 under `model`/`optim` (full: `full.pt`), replica r under
`replica_<r>` (full: `replica_<r>.pt`). A run with the same replica count
restores each replica's own copy (exact resume); any other layout starts every
replica from the mean of the saved copies, and says so in the log.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.distributed.tensor import DTensor

from harness.averaging import CrossReplica
from harness.compat import ReusableStager
from harness.dist import synchronize, true_on_every_rank

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"
FULL_FILE = "full.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and the fix."""


# --- finding checkpoints (pure: no torch.distributed; used by `validate` too) -----


def checkpoint_dir(cfg: DictConfig, run_dir: Path) -> Path:
    return Path(os.path.expanduser(cfg.dir)) if cfg.dir else run_dir / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """`step_<N>` directories under `root` that hold a `meta.json`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


def resume_path(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` asks for: None (start fresh) or a `step_<N>` dir."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        done = complete_checkpoints(checkpoint_dir(cfg, run_dir))
        return done[-1] if done else None
    path = Path(os.path.expanduser(cfg.resume))
    if not (path / META).is_file():  # a checkpoints folder: its newest complete one
        done = complete_checkpoints(path)
        return done[-1] if done else path  # read_meta names what is missing
    return path


def read_meta(path: Path) -> dict:
    """`meta.json` of the checkpoint at `path`; CheckpointError when missing or unreadable."""
    fix = "Fix: point checkpoint.resume at a step_<N> directory written by harness, or checkpoint.resume=never."
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume={str(path)!r}: no such file or directory. {fix}")
    try:
        return json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint.resume={str(path)!r} is not a complete checkpoint: it has no {META} "
                              f"(a save that did not finish, or not a harness checkpoint). {fix}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint.resume={str(path)!r}: {META} is unreadable ({e}); the checkpoint is "
                              f"corrupt. {fix}") from None


def check_compatible(meta: dict, cfg: DictConfig, path: Path) -> list[str]:
    """Why the checkpoint at `path` cannot resume the run configured by `cfg` (empty: it can)."""
    errors = []
    saved_model, model = meta["model"], OmegaConf.to_container(cfg.model, resolve=True)
    diffs = [f"model.{k}: saved {saved_model.get(k)!r}, configured {model.get(k)!r}"
             for k in sorted(set(saved_model) | set(model)) if saved_model.get(k) != model.get(k)]
    if diffs:
        errors.append(f"checkpoint.resume: the checkpoint at {str(path)!r} holds another model ({'; '.join(diffs)}). "
                      "Fix: set the model to the saved one (the overrides above), or checkpoint.resume=never "
                      "with a new hydra.run.dir to start fresh.")
    if meta["optimizer"] != cfg.optimizer._target_:
        errors.append(f"checkpoint.resume: the checkpoint at {str(path)!r} holds {meta['optimizer']} state, but "
                      f"optimizer._target_={cfg.optimizer._target_}. Fix: resume with the saved optimizer, or "
                      "checkpoint.resume=never with a new hydra.run.dir.")
    return errors


# --- what one checkpoint holds ---------------------------------------------------


@dataclass
class Layout:
    """Where this rank sits among the replicas, and whether they can or do differ."""

    replicas: int
    replica: int
    replica_leader: bool  # shard index 0 of its replica: writes the replica's full-mode file
    local_sgd: bool  # replicas train on their own between averaging steps
    diverged: bool  # ... and have done so already (past warmup), so each needs its own copy

    @property
    def copy_key(self) -> str | None:
        """Key of this rank's replica copy: None for the copy every run has (replica 0's)."""
        return f"replica_{self.replica}" if self.diverged and self.replica > 0 else None


def replica_layout(mesh: DeviceMesh, cross_replica: CrossReplica | None) -> Layout:
    averager = cross_replica.averager if cross_replica is not None else None
    return Layout(replicas=mesh["replicate"].size(), replica=mesh.get_local_rank("replicate"),
                  replica_leader=mesh.get_local_rank("shard") == 0, local_sgd=averager is not None,
                  diverged=averager is not None and averager.step > averager.warmup_steps)


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The local optimizer: PostLocalSGDOptimizer cannot go through the state-dict
    APIs (a fresh one fails in `step(closure=...)`, and its own `step` is dropped)."""
    return optimizer.optim if isinstance(optimizer, PostLocalSGDOptimizer) else optimizer


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # CPU ranks on a GPU machine never touch CUDA
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_full(state: Any, keep: bool) -> Any:
    """`state` with every tensor whole and on CPU where `keep`, None elsewhere.

    Gathers one tensor at a time (peak memory: one full tensor). PyTorch's
    `get_state_dict(full_state_dict=True, cpu_offload=True)` keeps the result on
    global rank 0 only; with diverged replicas each replica's first rank needs
    its own replica's copy.
    """
    if isinstance(state, dict):
        return {k: gather_full(v, keep) for k, v in state.items()}
    if isinstance(state, DTensor):
        state = state.full_tensor()  # collective: every rank gathers, in the same order
    if torch.is_tensor(state):
        return state.detach().cpu() if keep else None
    return state


def _describe(e: BaseException) -> str:
    """`Type: first line` of the error, or of the first rank's error inside DCP's CheckpointException."""
    cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
    return ": ".join([type(cause).__name__, *str(cause).splitlines()[:1]])[:300]


@contextmanager
def _writing(step: int, partial: Path):
    """A failed write (disk full, permissions) as one message; the save stays uncommitted."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(
            f"saving checkpoint step {step} to {str(partial)!r} failed ({_describe(e)}); it was not committed and "
            "earlier checkpoints are untouched. Fix: if the disk is full, free space or point checkpoint.dir at a "
            "disk with room (checkpoint/bytes in metrics.jsonl says how much one takes); if another rank died, "
            "its log says why.") from e


def _write_durably(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class PendingSave:
    staged: Future  # the CPU copy of the state is complete
    written: Future  # ... and on disk
    partial: Path
    meta: dict
    rngs: list | None  # rank 0: every rank's RNG states, written at commit
    started: float
    staging_wait_s: float = 0.0


class Checkpointer:
    """Saves on schedule (at most one async save in flight), loads at start.

    Collective: every rank calls `wait_for_staging` before each optimizer step,
    `after_step` after it, and `wait` at the end. Only rank 0 writes
    `meta.json`, renames and deletes.
    """

    def __init__(self, config: DictConfig, run_dir: Path, rank: int, device: torch.device):
        self.cfg, self.config, self.rank, self.device = config.checkpoint, config, rank, device
        self.root = checkpoint_dir(self.cfg, run_dir)
        self.async_save = bool(self.cfg["async"])
        # Async saves need their own (gloo) group: on the default group the
        # background thread's collectives crash against the loop's (verified on
        # torch 2.13), and on CUDA the default group is nccl, which DCP's async
        # path refuses.
        self.group = dist.new_group(backend="gloo") if self.async_save else None
        # Staging (the CPU copy of the state) runs in a background thread too,
        # reusing its buffers across saves; the loop waits for it only before the
        # next optimizer step changes the parameters (`wait_for_staging`). With
        # DCP's default synchronous stager the loop was blocked 23-47 % of a
        # sync save (bench/checkpoint.py); the target is <= 10 %. On CUDA the
        # copy goes to pinned host buffers on a side stream.
        cuda = device.type == "cuda"
        self.stager = ReusableStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=True, use_non_blocking_copy=cuda)
                                     ) if self.async_save else None
        self.pending: PendingSave | None = None

    # -- saving --

    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.mode != "none" and (step % self.cfg.interval == 0 or step == last_step)

    def after_step(self, job, step: int, last_step: int, extra: dict) -> dict:
        """Save if `step` is due; report an async save that finished. Returns metrics for this step."""
        row = self._poll()
        if self.due(step, last_step):
            row.update(self.save(job, step, extra))
        return row

    def save(self, job, step: int, extra: dict) -> dict:
        row = self.wait()  # at most one save in flight
        synchronize(self.device)  # the step's queued work is not the save's time
        start = time.perf_counter()
        layout = replica_layout(job.mesh, job.cross_replica)
        partial = self.root / f"step_{step}.partial"
        if self.rank == 0:
            self._remove_leftovers()
            partial.mkdir(parents=True)
        dist.barrier()
        optim = inner_optimizer(job.optimizer)
        if not true_on_every_rank(torch.stack([torch.isfinite(t).all() for t in _local_tensors(job.model, optim)]).all()):
            raise CheckpointError(f"refusing to save step {step}: parameters or optimizer state hold NaN/inf, and a "
                                  "checkpoint must never hold them. Fix: lower optimizer.lr or keep train.grad_clip > 0, "
                                  "and resume from the last checkpoint.")
        model_sd, optim_sd = get_state_dict(job.model, optim)
        rngs = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(rng_state(), rngs, dst=0)
        meta = {"step": step, "mode": self.cfg.mode, **extra, "world_size": dist.get_world_size(),
                "replica_copies": layout.replicas if layout.diverged else 1,
                "mesh": dict(zip(job.mesh.mesh_dim_names, job.mesh.shape)),
                "model": OmegaConf.to_container(self.config.model, resolve=True),
                "optimizer": self.config.optimizer._target_, "torch": torch.__version__,
                "config": OmegaConf.to_container(self.config, resolve=True)}
        if self.cfg.mode == "full":
            keep = layout.replica_leader and (layout.replica == 0 or layout.diverged)
            payload = gather_full({"model": model_sd, "optim": optim_sd}, keep)
            state_dict_s = time.perf_counter() - start
            if keep:
                name = FULL_FILE if layout.copy_key is None else f"{layout.copy_key}.pt"
                with _writing(step, partial):
                    _write_durably(payload, partial / name)
        else:
            payload = {"model": model_sd, "optim": optim_sd}
            if layout.copy_key is not None:
                payload = {layout.copy_key: payload}
            synchronize(self.device)
            state_dict_s = time.perf_counter() - start
            if self.async_save:
                response = dcp.async_save(payload, checkpoint_id=str(partial), process_group=self.group,
                                          async_stager=self.stager)
                self.pending = PendingSave(response.staging_completion, response.upload_completion, partial, meta,
                                           rngs, start)
                return {**row, "checkpoint/state_dict_s": state_dict_s,
                        "checkpoint/save_s": time.perf_counter() - start, "checkpoint/mode": self._mode_name()}
            with _writing(step, partial):
                dcp.save(payload, checkpoint_id=str(partial))
        if self.rank == 0:
            with _writing(step, partial):
                _write_durably(rngs, partial / "rng.pt")
        dist.barrier()  # every rank's part is on disk
        written = self._commit(partial, meta)
        return {**row, "checkpoint/state_dict_s": state_dict_s, "checkpoint/save_s": time.perf_counter() - start,
                "checkpoint/write_s": time.perf_counter() - start - state_dict_s, "checkpoint/mode": self._mode_name(),
                **written}

    def wait_for_staging(self) -> None:
        """Before parameters change: the async save in flight has its own copy of them."""
        if self.pending is not None and not self.pending.staged.done():
            start = time.perf_counter()
            self.pending.staged.result()
            self.pending.staging_wait_s += time.perf_counter() - start

    def wait(self) -> dict:
        """Block until the save in flight (if any) is durable; its metrics."""
        if self.pending is None:
            return {}
        with _writing(self.pending.meta["step"], self.pending.partial):
            self.pending.written.result()
        return self._finish_async()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()

    def _poll(self) -> dict:
        # Only rank 0 commits; every rank collects its own future's outcome so
        # background errors surface. No collective here: ranks finish at different steps.
        if self.pending is not None and self.pending.written.done():
            return self.wait()
        return {}

    def _finish_async(self) -> dict:
        pending, self.pending = self.pending, None
        # DCP's coordinator (rank 0) writes .metadata only after every rank's
        # files are written, so when rank 0's future is done the checkpoint is.
        if self.rank == 0:
            with _writing(pending.meta["step"], pending.partial):
                _write_durably(pending.rngs, pending.partial / "rng.pt")
        written = self._commit(pending.partial, pending.meta)
        return {"checkpoint/write_s": time.perf_counter() - pending.started,
                "checkpoint/staging_wait_s": pending.staging_wait_s, **written}

    def _commit(self, partial: Path, meta: dict) -> dict:
        if self.rank != 0:
            return {}
        meta["bytes"] = _dir_bytes(partial)
        (partial / META).write_text(json.dumps(meta, indent=1))
        _fsync_dir(partial)
        final = partial.with_name(partial.name.removesuffix(".partial"))
        partial.rename(final)
        _fsync_dir(final.parent)
        for old in complete_checkpoints(self.root)[:-self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint step %d saved to %s (%.1f MB)", meta["step"], final, meta["bytes"] / 1e6)
        return {"checkpoint/bytes": meta["bytes"]}

    def _remove_leftovers(self) -> None:
        """`.partial` directories of saves that never finished (a crash, a kill)."""
        if self.root.is_dir():
            for p in self.root.glob("step_*.partial"):
                log.warning("removing incomplete checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def _mode_name(self) -> str:
        return "sharded_async" if self.cfg.mode == "sharded" and self.async_save else self.cfg.mode


# --- loading ---------------------------------------------------------------------


def load(path: Path, job, rank: int) -> tuple[dict, dict]:
    """Restore model, optimizer and RNG from `path` into `job`; returns (meta, metrics).

    Collective. Raises CheckpointError naming the path when a file is
    missing or damaged.
    """
    start = time.perf_counter()
    meta = read_meta(path)
    layout = replica_layout(job.mesh, job.cross_replica)
    copies = meta["replica_copies"]
    optim = inner_optimizer(job.optimizer)
    set_s = 0.0

    def load_copy(copy: int) -> None:
        nonlocal set_s
        key = None if copy == 0 else f"replica_{copy}"
        try:
            if meta["mode"] == "full":
                state = torch.load(path / (FULL_FILE if key is None else f"{key}.pt"), map_location="cpu",
                                   mmap=True, weights_only=True)
                t = time.perf_counter()
                # Every rank holds the (memory-mapped) full dict and keeps its own
                # slice: no broadcast, and the pages are shared between local ranks.
                full = StateDictOptions(full_state_dict=True)
                set_model_state_dict(job.model, state["model"], options=full)
                set_optimizer_state_dict(job.model, optim, state["optim"], options=full)
            else:
                model_sd, optim_sd = get_state_dict(job.model, optim)
                target = {"model": model_sd, "optim": optim_sd}
                dcp.load(target if key is None else {key: target}, checkpoint_id=str(path))
                t = time.perf_counter()
                set_state_dict(job.model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(
                f"checkpoint.resume: loading {str(path)!r} failed ({_describe(e)}). "
                "The checkpoint is damaged or does not match this model. Fix: resume from an earlier checkpoint "
                "(checkpoint.resume=<its step_<N> dir>) or start fresh (checkpoint.resume=never).") from e
        set_s += time.perf_counter() - t

    if copies == 1:
        load_copy(0)
    elif layout.local_sgd and copies == layout.replicas:
        load_copy(layout.replica)
    else:
        if rank == 0:
            log.warning("checkpoint %s holds %d diverged replicas, this run has %d%s: every replica starts from "
                        "their mean", path, copies, layout.replicas,
                        "" if layout.local_sgd else " and no averager")
        _load_mean(job, optim, copies, load_copy)
    try:
        rngs = torch.load(path / "rng.pt", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint.resume: {str(path / 'rng.pt')!r} is missing or damaged ({_describe(e)}). "
                              "Fix: resume from an earlier checkpoint, or checkpoint.resume=never.") from e
    if len(rngs) == dist.get_world_size():
        set_rng_state(rngs[rank])
    elif rank == 0:
        log.warning("checkpoint %s was saved by %d ranks, this run has %d: RNG states not restored",
                    path, len(rngs), dist.get_world_size())
    synchronize(job.data.device)
    return meta, {"checkpoint/load_s": time.perf_counter() - start, "checkpoint/set_state_dict_s": set_s}


def _local_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's parameter shards and floating-point optimizer state, as in-place views."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p.data) for p in model.parameters()]
    for p in model.parameters():
        tensors += [local(v) for v in optim.state.get(p, {}).values()
                    if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
    return tensors


def _load_mean(job, optim, copies: int, load_copy) -> None:
    total = None
    for copy in range(copies):
        load_copy(copy)
        tensors = _local_tensors(job.model, optim)
        total = [t.clone() for t in tensors] if total is None else [a.add_(b) for a, b in zip(total, tensors)]
    for t, s in zip(_local_tensors(job.model, optim), total):
        t.copy_(s / copies)
