"""One rank's run: `run_rank` takes it from process group to teardown, and
`train` is the loop itself."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule

from harness.checkpoint import Checkpointer, checkpoint_dir, load, resume_path
from harness.config import TrainConf, plain
from harness.data import TokenStream
from harness.dist import DistEnv, init_distributed, mean_over_ranks, node_of_each_rank, teardown, true_on_every_rank
from harness.job import Job, build_job
from harness.mesh import describe_replicas
from harness.optim import clip_grad_norm_
from harness.rng import seed_rank
from harness.sinks import MetricsSink
from harness.throughput import memory_metrics, peak_flops

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop itself carries between steps (the rest of a checkpoint's
    state lives in the job: model, optimizer and its stateful parts)."""

    step: int = 0


def run_rank(cfg: DictConfig, run_dir: Path) -> None:
    """One rank of the run described by `cfg` (already validated)."""
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    seed_rank(cfg.train.seed, env.rank)
    sink = None
    try:
        job = build_job(cfg, env)
        run_config = plain(cfg)
        checkpointer = Checkpointer(
            cfg.checkpoint, checkpoint_dir(cfg.checkpoint, run_dir), env.rank, env.device, run_config
        )
        sink = MetricsSink(run_dir, cfg.wandb, run_config, enabled=env.is_main)
        log.info(
            "world %d, mesh %s, %s parameters, device %s",
            env.world_size,
            dict(zip(job.mesh.mesh_dim_names, job.mesh.shape)),
            f"{sum(p.numel() for p in job.model.parameters()):,}",
            env.device,
        )
        log.info("replicas: %s", describe_replicas(job.mesh, node_of_each_rank()))
        state = TrainState()
        path = resume_path(cfg.checkpoint, run_dir)
        if path is not None:
            row = restore(job, state, path, env.rank)
            sink.rewind(state.step)  # rows past the checkpoint are about to be logged again
            sink.log(row, state.step)
        train(job, sink, cfg.train, env, state, checkpointer)
        if final := checkpointer.wait():  # the last async save is durable before we exit
            sink.log(final, state.step)
        checkpointer.close()
        dist.barrier()  # no rank tears down while a peer still has collectives in flight
    finally:
        if sink is not None:
            sink.close()
        teardown()


def restore(job: Job, state: TrainState, path: Path, rank: int) -> dict:
    """Resume `job` from the checkpoint at `path`; returns the load metrics."""
    meta, row = load(path, job, rank)
    state.step = meta["step"]
    log.info("resumed from %s at step %d (%.2f s)", path, state.step, row["checkpoint/load_s"])
    return {
        **row,
        "run/resumed_from_step": state.step,
        "run/restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }


def train(
    job: Job, sink: MetricsSink, cfg: TrainConf, env: DistEnv, state: TrainState, checkpointer: Checkpointer
) -> None:
    """Train until `cfg.steps` steps are done: forward, backward, step (+ averaging), log, checkpoint."""
    model, optimizer = job.model, job.optimizer
    tokens_per_step = cfg.batch_size * cfg.seq_len * env.world_size
    peak = peak_flops(env.device, cfg.peak_tflops)
    last_time, last_step = time.perf_counter(), state.step
    while state.step < cfg.steps:
        step = state.step + 1
        log_step = step == 1 or step % cfg.log_every == 0 or step == cfg.steps
        inputs, targets = job.data.next_batch()
        loss = model(inputs, targets)
        if job.steps_in_backward:  # optimizer.in_backward: the parameters change during backward
            checkpointer.wait_for_staging()
        loss.backward()
        grad_norm = None  # the norm costs an all-reduce: only when clipping or logging (and gradients are kept)
        if (cfg.grad_clip > 0 or log_step) and not job.steps_in_backward:
            grad_norm = clip_grad_norm_(model.parameters(), cfg.grad_clip)
        finite = finite_on_every_rank(loss, grad_norm)
        if finite:
            checkpointer.wait_for_staging()  # an async save copies the parameters before they change
            optimizer.step()  # with an averager: the local step, then maybe averaging across replicas
        else:
            skip_nonfinite_step(cfg.nonfinite, step, job.steps_in_backward)  # raises unless train.nonfinite=skip
        optimizer.zero_grad(set_to_none=True)
        state.step = step

        row = job.cross_replica.step_metrics() if job.cross_replica is not None else {}
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            row["eval/loss"] = evaluate(job.model, job.data, cfg.eval_batches)
        saved = checkpointer.after_step(job, step, cfg.steps)
        row.update(saved)
        if not finite:
            row["train/skipped_nonfinite"] = 1
        if log_step:
            mean_loss = mean_over_ranks(loss)  # also waits for the device, so the clock below is honest
            step_time = (time.perf_counter() - last_time) / (step - last_step)
            row.update(
                {
                    "train/loss": mean_loss,
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "train/step_time_s": step_time,
                    "train/tokens_per_s": tokens_per_step / step_time,
                    **memory_metrics(env.device),
                }
            )
            if grad_norm is not None:
                row["train/grad_norm"] = grad_norm.item()
            if peak is not None:  # model FLOPs achieved per device over its peak
                row["train/mfu"] = row["train/tokens_per_s"] / env.world_size * job.flops_per_token / peak
            sink.log(row, step)
            if env.is_main:
                log.info(
                    "step %d/%d | loss %.4f | %s tok/s | %.3f s/step",
                    step,
                    cfg.steps,
                    mean_loss,
                    f"{row['train/tokens_per_s']:,.0f}",
                    step_time,
                )
            last_time, last_step = time.perf_counter(), step
        elif row.get("averager/averaged") or saved or not finite or "eval/loss" in row:  # and these steps
            sink.log(row, step)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenStream, batches: int) -> float:
    """Mean loss over the first `batches` held-out batches, averaged over ranks
    (between averagings: over the replicas, each scored on the same data).
    Dropout is off and no RNG is drawn, so an eval pass leaves training bitwise unchanged."""
    model.eval()
    total = sum(model(*data.eval_batch(index)) for index in range(batches))
    model.train()
    for module in model.modules():  # FSDP2 leaves the root unsharded after a forward without backward
        if isinstance(module, FSDPModule):
            module.reshard()
    return mean_over_ranks(total / batches)


class NonFiniteLossError(RuntimeError):
    """The loss or gradients became NaN/inf; the message names the step and the fix."""


def finite_on_every_rank(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
    """Agreed by all ranks: replicas training on their own can disagree, and a
    rank skipping alone would hang the rest."""
    finite = torch.isfinite(loss.detach()).all()
    if grad_norm is not None:
        finite &= torch.isfinite(grad_norm)
    return true_on_every_rank(finite)


def skip_nonfinite_step(policy: str, step: int, stepped_in_backward: bool) -> None:
    """`train.nonfinite=error` stops before the optimizer step (so no checkpoint
    holds the values); `skip` drops this step's gradients on every rank."""
    if policy == "error":
        where = (
            "stopped before averaging and saving (optimizer.in_backward: the step itself ran in backward)"
            if stepped_in_backward
            else "stopped before the optimizer step"
        )
        raise NonFiniteLossError(
            f"train: the loss or gradients are not finite (NaN/inf) at step {step}; {where}, so no checkpoint "
            "holds non-finite values. Fix: lower optimizer.lr, keep train.grad_clip > 0, resume from the last "
            "checkpoint, or train.nonfinite=skip to skip such steps."
        )
    log.warning("step %d: non-finite loss or gradients; skipped on every rank (train.nonfinite=skip)", step)
