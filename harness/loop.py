"""One rank's run: `run_rank` takes it from process group to teardown;
`Trainer` runs a built job (`harness.job.build_job`): resume, the loop, the
final save. Benches and tests use the same two calls."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from harness import metrics
from harness.averaging import local_optimizer, step_without_update
from harness.checkpoint import Checkpointer, checkpoint_dir, load
from harness.config import plain
from harness.data import TokenStream
from harness.dist import DistEnv, init_distributed, mean_over_ranks, node_of_each_rank, teardown
from harness.fault_tolerance.link import TorchftLink
from harness.fault_tolerance.outputs import PeersFinished, group_outputs
from harness.fault_tolerance.replica_group import ReplicaGroup
from harness.job import Job, build_job
from harness.mesh import describe_replicas
from harness.nonfinite import NonFiniteGuard
from harness.optim import clip_grad_norm_
from harness.plan import RunPlan
from harness.profiling import StepProfiler
from harness.rng import seed_rank
from harness.sinks import MetricsSink
from harness.slowdown import slowdown_for
from harness.throughput import memory_metrics, peak_flops

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop itself carries between steps (the rest of a checkpoint's
    state lives in the job: model, optimizer and its stateful parts)."""

    step: int = 0


def run_rank(cfg: DictConfig, run_dir: Path, plan: RunPlan) -> None:
    """One rank of the run described by `cfg` (already checked) and its `plan`."""
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    seed_rank(cfg.train.seed, plan.rank_in_mesh(env.rank))
    link, resume_from = None, plan.resume_from
    try:
        if plan.replica_id is not None:  # a replica group: its peers are reached through torchft's Manager
            run_dir, resume_from = group_outputs(cfg, run_dir, plan.replica_id)
            link = TorchftLink(cfg.fault_tolerance, plan.replica_id, env.rank, env.world_size, env.device)
        job = build_job(cfg, env, plan, link)
        log.info(
            "world %d, mesh %s, %s parameters, device %s",
            env.world_size,
            dict(zip(job.mesh.mesh_dim_names, job.mesh.shape)),
            f"{sum(p.numel() for p in job.model.parameters()):,}",
            env.device,
        )
        log.info("replicas: %s", describe_replicas(job.mesh, node_of_each_rank()))
        with Trainer(job, cfg, env, run_dir, resume_from, replica_group=plan.replica_id) as trainer:
            trainer.run()
    except PeersFinished as e:
        log.warning("%s", e)
    finally:
        if link is not None:
            link.shutdown()
        teardown()


class Trainer:
    """Trains a built job: `run()` to `train.steps` (or a step of the caller's,
    so a bench can time slices), resuming first from `resume_from`. Used as a
    context manager: leaving it normally makes the last async save durable and
    waits for every rank; leaving it in any way closes the metrics sinks."""

    def __init__(
        self,
        job: Job,
        cfg: DictConfig,
        env: DistEnv,
        run_dir: Path,
        resume_from: Path | None = None,
        replica_group: int | None = None,
    ):
        self.job, self.cfg, self.env = job, cfg.train, env
        # fault_tolerance=torchft: this world is replica group `replica_group`, its peers behind the replica link
        self.replica_group = None
        if replica_group is not None:
            ft, link = cfg.fault_tolerance, job.cross_replica.link
            self.replica_group = ReplicaGroup(self, link, replica_group, env.world_size, cfg.train.seed, ft, run_dir)
        run_config = plain(cfg)
        self.checkpointer = Checkpointer(
            cfg.checkpoint, checkpoint_dir(cfg.checkpoint, run_dir), env.rank, env.device, run_config
        )
        wandb = cfg.wandb
        if replica_group is not None:  # each group its own W&B run, in the job's W&B group
            job_name = run_dir.parent.name
            wandb = OmegaConf.merge(
                wandb, {"group": wandb.group or job_name, "name": f"{wandb.name or job_name}/group{replica_group}"}
            )
        self.sink = MetricsSink(run_dir, wandb, run_config, enabled=env.is_main, tensorboard=cfg.metrics.tensorboard)
        self.nonfinite = NonFiniteGuard(
            cfg.train.nonfinite, local_optimizer(job.optimizer), env.device, cfg.train.log_every, job.steps_in_backward
        )
        self.state = TrainState()
        pace = job.cross_replica.pace if job.cross_replica is not None else None
        # averager.balance=time: replicas take their own number of local steps; they meet at exchanges
        self.pace = pace if pace is not None and pace.balances else None
        replica = replica_group if replica_group is not None else job.mesh["replicate"].get_local_rank()
        self.slowdown = slowdown_for(replica)  # tests and benches only
        self.profiler = None
        if resume_from is not None:
            try:
                self.restore(resume_from)
            except BaseException:  # not yet inside `with`: close the sinks here
                self.sink.close()
                raise
        if cfg.train.profile.enabled:  # last: nothing after it can fail and leave it running
            self.profiler = StepProfiler(cfg.train.profile, run_dir, env.rank, env.device)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        try:
            if exc_type is None:
                if final := self.checkpointer.wait():  # the last async save is durable before we exit
                    self.sink.log(final, self.state.step)
                self.checkpointer.close()
                if self.job.cross_replica is not None:
                    self.job.cross_replica.wait()
                dist.barrier()  # no rank tears down while a peer still has collectives in flight
                if self.replica_group is not None and self.state.step >= self.cfg.steps:
                    self.replica_group.finish()
        finally:
            self.sink.close()

    def restore(self, path: Path) -> None:
        """Resume from the checkpoint at `path`; its load metrics are logged at its step."""
        meta, row = load(path, self.job, self.env.rank)
        self.state.step = meta["step"]
        log.info("resumed from %s at step %d (%.2f s)", path, self.state.step, row[metrics.CHECKPOINT_LOAD])
        self.sink.rewind(self.state.step)  # rows past the checkpoint are about to be logged again
        row[metrics.RUN_RESUMED_FROM] = self.state.step
        row[metrics.RUN_RESTARTS] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.sink.log(row, self.state.step)

    def run(self, until: int | None = None) -> None:
        """Train until step `until` (default and at most `train.steps`): forward,
        backward, step (+ averaging across replicas), eval, checkpoint, log."""
        job, cfg, state = self.job, self.cfg, self.state
        until = cfg.steps if until is None else min(until, cfg.steps)
        self._clock = time.perf_counter(), state.step
        self._last_met = state.step  # the last step every rank took together (log, eval and save fall on those)
        while state.step < until:
            if self.replica_group is not None:  # a quorum, when this step crosses replicas; a heal sets state.step
                self.replica_group.before_step()
            since, synchronous = state.step, job.cross_replica is None or job.cross_replica.synchronous
            step = self._step_after(since)
            # a synchronous step's backward holds the gradient exchange, which a slower device would not stretch
            slowed = self.slowdown is not None and not synchronous
            if slowed:
                self.slowdown.begin()
            loss = self._forward_backward()
            grad_norm = None  # in backward each gradient was freed once its parameter stepped
            if not job.steps_in_backward:  # the norm is also the non-finite check, on the device
                grad_norm = clip_grad_norm_(job.model.parameters(), cfg.grad_clip)
            if slowed:
                self.slowdown.after_compute(self.env.device)
            # balance=time, a local step: this replica's ranks alone agree, on the step as it counts them
            local = self.pace is not None and not synchronous
            check_step = job.cross_replica.averager.step + 1 if local else step
            finite = self.nonfinite.check(  # False: skipped by the host's check
                check_step, loss, grad_norm, job.mesh.get_group("shard") if local else None
            )
            self.checkpointer.wait_for_staging()  # an async save copies the parameters before they change
            if job.cross_replica is not None and job.cross_replica.pace is not None:
                job.cross_replica.pace.observe(loss)  # the period's length may follow it (adacomm)
            if finite and (self.replica_group is None or self.replica_group.gradients_committed()):
                job.optimizer.step()  # with an averager: the local step, then maybe averaging across replicas
            else:  # a skipped step still counts, as one skipped on the device does: maybe averaging across replicas
                if finite:  # fault tolerance: a synchronous step whose gradient exchange did not commit
                    log.warning("step %d: the gradient exchange across replica groups failed; step skipped", step)
                step_without_update(job.optimizer)
            if self.replica_group is not None and step == cfg.steps:  # the run ends with the survivors' average
                self.replica_group.complete_the_last_exchange()
            job.optimizer.zero_grad(set_to_none=True)
            lr = job.lr_schedule.lr  # the rate this step trained at, for the log
            for _ in range(step - since):  # the learning rate is a function of the step, skipped steps included
                job.lr_schedule.step()
            state.step = step
            self._after_step(since, step, loss, grad_norm, lr, finite, synchronous, check_step)
            if job.cross_replica is not None and job.cross_replica.pace is not None:
                job.cross_replica.pace.after_step()  # an exchange's log, eval and save are left out of step times
            if self.profiler is not None:
                self.profiler.step()

    def _step_after(self, since: int) -> int:
        """The run's step once this step is taken: the next, or with `averager.balance=time` the global
        step the replicas' local steps add up to (`Pace.global_step`: it may stay, or move by several)."""
        if self.pace is None:
            return since + 1
        return self.pace.global_step(self.job.cross_replica.averager.step + 1)

    def _forward_backward(self) -> torch.Tensor:
        """Forward and backward over the step's `train.grad_accum` micro-batches, each
        loss scaled by 1/K so the gradients add up to one batch of K·B's; their mean loss."""
        job, micro_batches = self.job, self.cfg.grad_accum
        loss = None
        for micro in range(micro_batches):
            inputs, targets = job.data.next_batch()
            with gradient_sync(job, micro_batches, last=micro == micro_batches - 1):
                micro_loss = job.model(inputs, targets)
                if micro_batches > 1:
                    micro_loss = micro_loss / micro_batches
                if job.steps_in_backward:  # optimizer.in_backward: the parameters change during backward
                    self.checkpointer.wait_for_staging()
                self.nonfinite.backward(micro_loss)  # a non-finite loss makes the gradients NaN
            loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
        return loss

    def _after_step(
        self,
        since: int,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        lr: float,
        finite: bool,
        synchronous: bool,
        check_step: int,
    ) -> None:
        """Eval and checkpoint when due; log this step's row on log steps and on
        steps where something happened (averaging, eval, a save, a skipped step).
        With `averager.balance=time` these fall only where every rank meets: an
        exchange, a synchronous step, the last step; `check_step` is the step as the
        non-finite check counted it (a replica's own count, there)."""
        job, cfg = self.job, self.cfg
        averaged = job.cross_replica is not None and job.cross_replica.averaged_this_step
        if self.pace is not None:  # the Pace's exchanges are where every rank meets (one that did not commit too)
            averaged = self.pace.exchanged
        if self.pace is not None and not (averaged or synchronous or step == cfg.steps):
            if not finite:  # the host's check skipped it: a row of rank 0's own
                self.sink.log({metrics.TRAIN_SKIPPED_NONFINITE: 1}, step)
            return
        met = self._last_met if self.pace is not None else since  # a heal may have moved `since`
        self._last_met = step

        def reached(every: int) -> bool:  # a multiple of `every` since the last meeting
            return every > 0 and (step // every > met // every or step == cfg.steps)

        log_step = met == 0 or reached(cfg.log_every)
        row = {}
        evaluated = reached(cfg.eval_every)
        saving = self.checkpointer.due(step, cfg.steps, met)
        waits = log_step or averaged or evaluated or saving  # the host waits anyway
        if waits or self.nonfinite.due(check_step):
            row.update(self.nonfinite.report(check_step))  # train.nonfinite=error raises here, before eval and save
        if evaluated:
            row.update(evaluate(job.model, job.data, cfg.eval_batches))
        saved = self.checkpointer.after_step(job, step, cfg.steps, met)
        row.update(saved)
        if not finite:
            row[metrics.TRAIN_SKIPPED_NONFINITE] = 1
        if self.replica_group is not None:
            row.update(self.replica_group.step_metrics())
        if log_step:
            row.update(self._progress(step, loss, grad_norm, lr, row.get(metrics.EVAL_LOSS)))
        elif evaluated and self.env.is_main:
            log.info("step %d/%d | eval loss %.4f", step, cfg.steps, row[metrics.EVAL_LOSS])
        skipped = metrics.TRAIN_SKIPPED_NONFINITE in row  # this step (the host's check), or reported here
        if log_step or averaged or evaluated or saved or skipped or metrics.FT_QUORUM_TIME in row:
            if job.cross_replica is not None:  # its bytes since the previous logged row
                row.update(job.cross_replica.step_metrics())
            self.sink.log(row, step)

    def _progress(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None, lr: float, eval_loss: float | None
    ) -> dict:
        """Loss, speed and memory since the previous log step; rank 0 prints a line (with
        this step's `eval_loss`, if it evaluated)."""
        mean_loss = mean_over_ranks(loss)  # also waits for the device, so the clock below is honest
        since, since_step = self._clock
        step_time = (time.perf_counter() - since) / (step - since_step)
        tokens_per_s = self.cfg.grad_accum * self.cfg.batch_size * self.cfg.seq_len * self.env.world_size / step_time
        row = {
            metrics.TRAIN_LOSS: mean_loss,
            metrics.TRAIN_LR: lr,
            metrics.TRAIN_STEP_TIME: step_time,
            metrics.TRAIN_TOKENS_PER_S: tokens_per_s,
            **memory_metrics(self.env.device),
            **self.job.data.tokens_read(),
        }
        if grad_norm is not None:
            row[metrics.TRAIN_GRAD_NORM] = grad_norm.item()
        peak = peak_flops(self.env.device, self.cfg.peak_tflops)
        if peak is not None:  # model FLOPs achieved per device over its peak
            row[metrics.TRAIN_MFU] = tokens_per_s / self.env.world_size * self.job.flops_per_token / peak
        if self.env.is_main:
            log.info(
                "step %d/%d | loss %.4f%s | %s tok/s | %.3f s/step",
                step,
                self.cfg.steps,
                mean_loss,
                "" if eval_loss is None else f" | eval loss {eval_loss:.4f}",
                f"{tokens_per_s:,.0f}",
                step_time,
            )
        self._clock = time.perf_counter(), step
        return row


def gradient_sync(job: Job, micro_batches: int, last: bool):
    """Gradient accumulation: the gradient reduction (FSDP2's reduce-scatter, DDP's
    all-reduce, a one-device replica's `GradientReduction`, and with them the
    warmup's cross-replica hook) runs only on a step's last micro-batch; the
    others accumulate locally."""
    model = job.model
    if micro_batches == 1:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if last else model.no_sync()
    if job.gradient_reduction is not None:
        job.gradient_reduction.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if not isinstance(model, FSDPModule):  # a one-device replica with no peers: nothing to reduce
        return contextlib.nullcontext()
    # FSDP2, on every FSDP module below the root; parameters also stay unsharded between
    # micro-batches, so the next forward needs no all-gather (as FSDP2's docs advise)
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenStream, batches: int) -> dict:
    """`eval/loss`: the mean loss over the first `batches` held-out batches, averaged
    over ranks (between averagings: over the replicas, each scored on the same data);
    with a mixture, `eval/loss/<source>` for each source and `eval/loss` their weighted mean.
    Dropout is off and no RNG is drawn, so an eval pass leaves training bitwise unchanged."""
    model.eval()
    sources = data.eval_sources()  # a mixture's (name, weight); [] for one dataset
    which = range(len(sources)) if sources else [None]
    losses = [mean_over_ranks(sum(model(*data.eval_batch(i, s)) for i in range(batches)) / batches) for s in which]
    model.train()
    for module in model.modules():  # FSDP2 leaves the root unsharded after a forward without backward
        if isinstance(module, FSDPModule):
            module.reshard()
    if not sources:
        return {metrics.EVAL_LOSS: losses[0]}
    row = {metrics.EVAL_SOURCE_LOSS.named(name): loss for (name, _), loss in zip(sources, losses)}
    row[metrics.EVAL_LOSS] = sum(weight * loss for (_, weight), loss in zip(sources, losses))
    return row
