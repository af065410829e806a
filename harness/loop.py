"""One rank's run: `run_rank` takes it from process group to teardown;
`Trainer` runs a built job (`harness.job.build_job`): resume, the loop, the
final save. Benches and tests use the same two calls."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from harness import metrics
from harness.averaging import local_optimizer, step_without_update
from harness.checkpoint import Checkpointer, checkpoint_dir, load
from harness.clock import Tick
from harness.config import plain
from harness.data import TokenStream
from harness.dist import DistEnv, init_distributed, mean_over_ranks, node_of_each_rank, teardown
from harness.fault_tolerance.link import TorchftLink
from harness.fault_tolerance.outputs import PeersFinished, group_outputs
from harness.fault_tolerance.replica_group import ReplicaGroup
from harness.job import Job, build_job
from harness.mesh import describe_replicas
from harness.models import parameter_count
from harness.nonfinite import NonFiniteGuard
from harness.optim import clip_grad_norm_
from harness.plan import RunPlan
from harness.profiling import StepProfiler
from harness.rng import seed_rank
from harness.sinks import MetricsSink
from harness.slowdown import slowdown_for
from harness.throughput import memory_metrics, peak_flops

log = logging.getLogger(__name__)


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
            "world %d, mesh %s, %s parameters, device %s%s",
            env.world_size,
            dict(zip(job.mesh.mesh_dim_names, job.mesh.shape)),
            f"{parameter_count(job.model):,}",
            env.device,
            f", {torch.get_num_threads()} thread(s)" if env.device.type == "cpu" else "",
        )
        log.info("replicas: %s", describe_replicas(job.mesh, node_of_each_rank()))
        with Trainer(job, cfg, env, run_dir, resume_from, plan.resume_with, plan.replica_id) as trainer:
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
        resume_with: tuple[Path, ...] = (),
        replica_group: int | None = None,
    ):
        self.job, self.cfg, self.env = job, cfg.train, env
        self.clock = job.clock  # where the run stands: the loop moves it, every part asks it
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
            cfg.train.nonfinite,
            local_optimizer(job.optimizer),
            env.device,
            cfg.train.log_every,
            job.steps_in_backward,
            job.mesh.get_group("shard"),
        )
        self.slowdown = slowdown_for(self.clock.replica)  # tests and benches only
        self.profiler = None
        if resume_from is not None:
            try:
                self.restore(resume_from, resume_with)
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
                    self.sink.log(final, self.clock.step)
                self.checkpointer.close()
                if self.job.cross_replica is not None:
                    self.job.cross_replica.wait()
                dist.barrier()  # no rank tears down while a peer still has collectives in flight
                if self.replica_group is not None and self.clock.finished:
                    self.replica_group.finish()
        finally:
            self.sink.close()

    def restore(self, path: Path, others: tuple[Path, ...] = ()) -> None:
        """Resume from the checkpoint at `path` (with `others`, replica groups' at its step: from their mean);
        its load metrics are logged at its step."""
        row = load(path, self.job, self.env.rank, others).row
        step = self.clock.step
        log.info("resumed from %s at step %d (%.2f s)", path, step, row[metrics.CHECKPOINT_LOAD])
        if aside := self.sink.rewind(step):  # rows past the checkpoint are about to be logged again
            log.warning("metrics.jsonl held rows past step %d, of the run before this resume: moved to %s", step, aside)
        row[metrics.RUN_RESUMED_FROM] = step
        row[metrics.RUN_RESTARTS] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.sink.log(row, step)

    def run(self, until: int | None = None) -> None:
        """Train until step `until` (default and at most `train.steps`): each local step as the clock
        says it is: forward, backward, step (+ averaging across replicas), eval, checkpoint, log."""
        job, clock = self.job, self.clock
        until = self.cfg.steps if until is None else min(until, self.cfg.steps)
        self._since = time.perf_counter(), clock.step  # the progress line's clock ...
        self._aside = 0.0  # ... and the seconds since then spent on eval passes and saves
        while clock.step < until and not clock.finished:
            tick = clock.next()
            if job.cross_replica is not None:
                job.cross_replica.before_step()  # DiLoCo: a delayed sync due before the forward
            if self.replica_group is not None:  # a quorum where the step crosses replicas; a heal moves the clock
                tick = self.replica_group.before_step(tick)
            loss, grad_norm = self._forward_backward(tick)
            clock.computed(loss)  # a period's step time ends here; its length may follow the loss (adacomm)
            finite = self.nonfinite.check(tick, loss, grad_norm)  # False: skipped by the host's check
            # an async save copies the parameters before they change; its wait is the save's, not the step's
            clock.waited(self.checkpointer.wait_for_staging())
            if finite and (self.replica_group is None or self.replica_group.gradients_committed(tick)):
                job.optimizer.step()  # with an averager: the local step, then what the clock says crosses replicas
            else:  # a skipped step still counts, as one skipped on the device does: what falls after it happens
                if finite:  # fault tolerance: a synchronous step whose gradient exchange did not commit
                    log.warning("step %d: the gradient exchange across replica groups failed; step skipped", tick.step)
                step_without_update(job.optimizer)
            if self.replica_group is not None and tick.last:  # the run ends with the survivors' average
                self.replica_group.complete_the_last_exchange(tick)
            job.optimizer.zero_grad(set_to_none=True)
            lr = job.lr_schedule.lr  # the rate this step trained at, for the log
            for _ in range(tick.lr_steps):  # the learning rate is a function of the step, skipped steps included
                job.lr_schedule.step()
            clock.advance()
            self._after_step(tick, loss, grad_norm, lr, finite)
            if self.profiler is not None:
                self.profiler.step()

    def _forward_backward(self, tick: Tick) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward over the step's `train.grad_accum` micro-batches, each loss scaled by
        1/K so the gradients add up to one batch of K·B's, then the gradient norm (clipped; it is
        also the non-finite check, on the device). Returns their mean loss and the norm (None with
        the optimizer in backward: each gradient was freed once its parameter stepped)."""
        job, micro_batches = self.job, self.cfg.grad_accum
        # a synchronous step's backward holds the gradient exchange, which a slower device would not stretch
        slowed = self.slowdown is not None and not tick.synchronous
        if slowed:
            self.slowdown.begin()
        loss = None
        for micro in range(micro_batches):
            inputs, targets = job.data.next_batch()
            with gradient_sync(job, micro_batches, last=micro == micro_batches - 1):
                micro_loss = job.model(inputs, targets)
                if micro_batches > 1:
                    micro_loss = micro_loss / micro_batches
                if job.steps_in_backward:  # optimizer.in_backward: the parameters change during backward
                    self.clock.waited(self.checkpointer.wait_for_staging())
                self.nonfinite.backward(micro_loss)  # a non-finite loss makes the gradients NaN
            loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
        grad_norm = None if job.steps_in_backward else clip_grad_norm_(job.model.parameters(), self.cfg.grad_clip)
        if slowed:
            self.slowdown.after_compute(self.env.device)
        return loss, grad_norm

    def _after_step(
        self, tick: Tick, loss: torch.Tensor, grad_norm: torch.Tensor | None, lr: float, finite: bool
    ) -> None:
        """Where every rank meets (the clock's meetings: every step with replicas in step), eval and
        checkpoint when due, and log this step's row on log steps and on steps where something happened
        (averaging, eval, a save, a skipped step)."""
        job, cfg = self.job, self.cfg
        if not tick.meeting:
            if not finite:  # the host's check skipped it: a row of rank 0's own
                self.sink.log({metrics.TRAIN_SKIPPED_NONFINITE: 1}, tick.step)
            return
        averaged = tick.exchange is not None or (job.cross_replica is not None and job.cross_replica.averaged_this_step)
        log_step = tick.met == 0 or tick.reached(cfg.log_every)
        evaluated = tick.reached(cfg.eval_every)
        saving = self.checkpointer.due(tick)
        row = {}
        if log_step or averaged or evaluated or saving or self.nonfinite.due(tick):  # the host waits anyway
            row.update(self.nonfinite.report(tick))  # train.nonfinite=error raises here, before eval and save
        started = time.perf_counter()
        if evaluated:
            row.update(evaluate(job.model, job.data, cfg.eval_batches))
            row[metrics.EVAL_TIME] = time.perf_counter() - started
        saved = self.checkpointer.after_step(job, tick)
        row.update(saved)
        self._aside += time.perf_counter() - started  # eval and save: not the steps' time
        if not finite:
            row[metrics.TRAIN_SKIPPED_NONFINITE] = 1
        if self.replica_group is not None:
            row.update(self.replica_group.step_metrics())
        if log_step:
            row.update(self._progress(tick.step, loss, grad_norm, lr, row.get(metrics.EVAL_LOSS)))
        elif evaluated and self.env.is_main:
            log.info("step %d/%d | eval loss %.4f", tick.step, cfg.steps, row[metrics.EVAL_LOSS])
        skipped = metrics.TRAIN_SKIPPED_NONFINITE in row  # this step (the host's check), or reported here
        if log_step or averaged or evaluated or saved or skipped or metrics.FT_QUORUM_TIME in row:
            if job.cross_replica is not None:  # its bytes since the previous logged row
                row.update(job.cross_replica.step_metrics())
            self.sink.log(row, tick.step)

    def _progress(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None, lr: float, eval_loss: float | None
    ) -> dict:
        """Loss, speed and memory since the previous log step; rank 0 prints a line (with
        this step's `eval_loss`, if it evaluated)."""
        mean_loss = mean_over_ranks(loss)  # also waits for the device, so the clock below is honest
        since, since_step = self._since
        step_time = (time.perf_counter() - since - self._aside) / (step - since_step)
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
        self._since, self._aside = (time.perf_counter(), step), 0.0
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
def evaluate(model: torch.nn.Module, data: TokenStream, batches: int | str) -> dict:
    """`eval/loss`: the mean loss over `batches` held-out batches spread over the held-out split
    (every window with "all"; `TokenStream.eval_windows`), averaged over ranks (between averagings:
    over the replicas, each scored on the same data); with a mixture, `eval/loss/<source>` for each
    source and `eval/loss` their weighted mean. Dropout is off and no RNG is drawn, so an eval pass
    leaves training bitwise unchanged."""
    model.eval()
    sources = data.eval_sources()  # a mixture's (name, weight); [] for one dataset
    losses = []
    for source in range(len(sources)) if sources else [None]:
        total, windows = 0.0, 0
        for batch in data.eval_windows(batches, source):  # every window alike: the mean of batch means, weighted
            total = total + model(*data.eval_batch(batch, source)) * len(batch)
            windows += len(batch)
        losses.append(mean_over_ranks(total / windows))
    model.train()
    for module in model.modules():  # FSDP2 leaves the root unsharded after a forward without backward
        if isinstance(module, FSDPModule):
            module.reshard()
    if not sources:
        return {metrics.EVAL_LOSS: losses[0]}
    row = {metrics.EVAL_SOURCE_LOSS.named(name): loss for (name, _), loss in zip(sources, losses)}
    row[metrics.EVAL_LOSS] = sum(weight * loss for (_, weight), loss in zip(sources, losses))
    return row
