"""The hand-written loops the benches measure the harness against: each trains
the model the config names from the same initial weights (`materialize`, seeded
by name), with the same optimizer (`build_optimizer`: class, hyperparameters,
fused choice) on the same batches (`build_data`), and nothing else - no
metrics, no checks, no hooks of the harness's.

- `minimal_fsdp2`: FSDP2 applied by hand on the harness's mesh, with the
  harness's mixed-precision policy, and `harness.optim.clip_grad_norm_`;
- `plain`: a plain module on its device, fp32 parameters, autocast to the
  compute dtype, the same clip (torch's `clip_grad_norm_` arithmetic, one
  foreach norm), so its parameters can be compared bit for bit. Synchronous
  replicas of one device (`gradients`): each rank trains its own copy
  (`None`), or the gradients' mean over the world is taken after backward in
  the buckets the harness uses (`"buckets"`: reverse parameter order, about
  `BUCKET_BYTES` each, one all-reduce each, nothing overlapped), or by torch's
  DistributedDataParallel (`"ddp"`: its buckets, overlapped with backward).

Each returns `(model, steps)`; `steps(n)` trains n steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from harness.data import build_data
from harness.job import BUCKET_BYTES
from harness.models import build_model, materialize
from harness.optim import build_optimizer, clip_grad_norm_
from harness.sharding import RESHARD_AFTER_FORWARD, compile_blocks, resolve_dtype


def minimal_fsdp2(cfg, mesh, env, compiled: bool = False):
    device = env.device
    model = build_model(cfg.model, cfg.train.seq_len)
    if compiled:
        compile_blocks(model)  # before sharding, as build_job does: FSDP2's hooks stay outside the graphs
    fsdp_mesh = mesh if mesh["replicate"].size() > 1 else mesh["shard"]
    policy = MixedPrecisionPolicy(
        param_dtype=resolve_dtype(cfg.sharding.param_dtype, device, low_precision_on_cuda=True),
        reduce_dtype=resolve_dtype(cfg.sharding.reduce_dtype, device, low_precision_on_cuda=False),
    )
    reshard = RESHARD_AFTER_FORWARD[cfg.sharding.strategy]
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    materialize(model, device, cfg.train.seed)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), device)
    data = build_data(cfg, env.rank, env.world_size, device)
    max_norm = cfg.train.grad_clip

    def steps(n: int) -> None:
        for _ in range(n):
            inputs, targets = data.next_batch()
            model(inputs, targets).backward()
            if max_norm > 0:
                clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return model, steps


def plain(cfg, env, compiled: bool = False, gradients: str | None = None):
    device = env.device
    model = build_model(cfg.model, cfg.train.seq_len)
    materialize(model, device, cfg.train.seed)  # fp32 parameters, the same initial values
    dtype = resolve_dtype(cfg.sharding.param_dtype, device, low_precision_on_cuda=True)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), device)  # fused on CUDA (optimizer.fused=null)
    forward = torch.compile(model) if compiled else model  # the whole model and its loss
    if gradients == "ddp":
        forward = DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None)
    data = build_data(cfg, env.rank, env.world_size, device)
    max_norm = cfg.train.grad_clip
    buckets = mean_buckets(list(model.parameters())) if gradients == "buckets" else []

    def steps(n: int) -> None:
        for _ in range(n):
            inputs, targets = data.next_batch()
            amp = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
            with amp:
                loss = forward(inputs, targets)
            loss.backward()
            for bucket in buckets:
                grads = [p.grad for p in bucket]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat.div_(dist.get_world_size())
                torch._foreach_copy_(
                    grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]
                )
            if max_norm > 0:
                clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return model, steps


def mean_buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters in reverse order, in runs of about BUCKET_BYTES of fp32 gradients: the harness's buckets."""
    runs, size = [[]], 0
    for p in reversed(params):
        if runs[-1] and size + p.numel() * 4 > BUCKET_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += p.numel() * 4
    return runs
