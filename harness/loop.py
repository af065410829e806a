"""`run` assembles one rank's training job from the config; `train` is the loop."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from harness.data import TokenStream, build_data
from harness.dist import DistEnv, init_distributed, mean_over_ranks, teardown
from harness.mesh import build_mesh
from harness.metrics import MetricsSink, memory_metrics
from harness.models import build_model
from harness.optim import build_optimizer
from harness.sharding import apply_sharding

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop itself carries between steps (checkpointed with the rest)."""

    step: int = 0


def run(cfg: DictConfig, run_dir: Path) -> None:
    """One rank of the job described by `cfg` (already validated)."""
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    sink = None
    try:
        mesh = build_mesh(cfg.sharding.strategy, cfg.sharding.replicate, env.world_size, env.device.type)
        model = build_model(cfg.model, cfg.train.seq_len)
        model = apply_sharding(model, mesh, cfg.sharding, env.device, cfg.train.seed)
        optimizer = build_optimizer(cfg.optimizer, model)
        data = build_data(cfg.data, cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len,
                          cfg.train.seed, env.rank, env.world_size, env.device)
        sink = MetricsSink(run_dir, cfg.wandb, OmegaConf.to_container(cfg, resolve=True), enabled=env.is_main)
        log.info("world %d, mesh %s, %s parameters, device %s", env.world_size, dict(zip(mesh.mesh_dim_names, mesh.shape)),
                 f"{sum(p.numel() for p in model.parameters()):,}", env.device)
        train(model, optimizer, data, sink, cfg.train, env, TrainState())
    finally:
        if sink is not None:
            sink.close()
        teardown()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: TokenStream, sink: MetricsSink,
          cfg: DictConfig, env: DistEnv, state: TrainState) -> None:
    tokens_per_step = cfg.batch_size * cfg.seq_len * env.world_size
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    last_time, last_step = time.perf_counter(), state.step
    while state.step < cfg.steps:
        inputs, targets = data.next_batch()
        loss = model(inputs, targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1

        if state.step == 1 or state.step % cfg.log_every == 0 or state.step == cfg.steps:
            mean_loss = mean_over_ranks(loss)  # also waits for the device, so the clock below is honest
            step_time = (time.perf_counter() - last_time) / (state.step - last_step)
            row = {"train/loss": mean_loss, "train/lr": optimizer.param_groups[0]["lr"],
                   "train/grad_norm": _scalar(grad_norm), "train/step_time_s": step_time,
                   "train/tokens_per_s": tokens_per_step / step_time, **memory_metrics(env.device)}
            sink.log(row, state.step)
            if env.is_main:
                log.info("step %d/%d | loss %.4f | %s tok/s | %.3f s/step", state.step, cfg.steps, mean_loss,
                         f"{row['train/tokens_per_s']:,.0f}", step_time)
            last_time, last_step = time.perf_counter(), state.step


def _scalar(t: torch.Tensor) -> float:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).item()
