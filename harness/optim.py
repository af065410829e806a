"""The local optimizer, built from `cfg.optimizer` by Hydra's `instantiate`, and gradient clipping.

Any `torch.optim` class is one YAML file away: `_target_` names the class,
`_partial_: true` leaves the parameters to be filled in here. With
`optimizer.in_backward=true` it is one optimizer per parameter, stepped during
backward (`StepInBackward`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from harness.config import decays_matrices_only
from harness.dist import local_view

HARNESS_KEYS = ("in_backward", "decay_1d")  # optimizer-group keys the harness reads, not the class's arguments


# the classes whose fused kernel DTensor (FSDP2's parameters) can run: torch registers sharding strategies
# for `_fused_adam_` and `_fused_adamw_` only (checked on 2.11 and 2.13; `_fused_sgd_` raises NotImplementedError)
FUSED_ON_DTENSORS = ("torch.optim.Adam", "torch.optim.AdamW")


def build_optimizer(cfg: DictConfig, params, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over `params`, which live on `device`, in the
    groups `param_groups` makes. `fused: null` picks the fused kernels on CUDA
    (one launch for all parameters; and a non-finite step is skipped on the
    device, harness.nonfinite) where they run on these parameters, and the
    class's own default elsewhere."""
    spec = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in HARNESS_KEYS}
    params = list(params)
    if "fused" in spec and spec["fused"] is None:
        sharded = any(isinstance(p, DTensor) for p in params)
        fusable = not sharded or spec["_target_"] in FUSED_ON_DTENSORS
        spec["fused"] = True if device.type == "cuda" and fusable else None
    return instantiate(spec, _convert_="all")(param_groups(cfg, params))


def param_groups(cfg: DictConfig, params) -> list:
    """`params` as the optimizer's groups: with `weight_decay` set and
    `decay_1d=false`, the configured decay for parameters of 2 or more
    dimensions (matrices, embeddings) and none for the rest (biases, norm
    weights), as nanoGPT and torchtitan do; otherwise one group (a plain list).
    An empty group is left out. By `ndim`, which a DTensor reports for the full
    tensor and its local shard shares (sharding splits dimensions, never
    flattens them), so DiLoCo's outer copies of the local shards group like
    their parameters."""
    params = list(params)
    if not decays_matrices_only(cfg):
        return params
    matrices = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    groups = [{"params": matrices}, {"params": others, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_local_optimizer(cfg: DictConfig, params, device: torch.device):
    """The local optimizer: one over all `params`, or `StepInBackward` with `optimizer.in_backward`."""
    return StepInBackward(cfg, params, device) if cfg.get("in_backward") else build_optimizer(cfg, params, device)


class StepInBackward:
    """`optimizer.in_backward=true`: one optimizer per parameter, stepped from the
    parameter's post-accumulate-grad hook, which FSDP2 runs on the sharded
    parameter as soon as its gradient is reduced (after the warmup's
    cross-replica all-reduce), and the gradient freed at once, so the whole
    model's gradients never exist together (PyTorch's
    `_apply_optimizer_in_backward`, torchtitan's optimizer in backward).

    Each parameter's optimizer is `build_optimizer` over that parameter alone,
    so it gets the weight decay its group would (`param_groups`). Stands in for
    the optimizer in the loop: `step` has nothing left to do
    (PostLocalSGDOptimizer's averaging still follows it); its `param_groups`
    is one group over every parameter (the logged lr, the averager's
    parameters);
    `optimizers` are the per-parameter ones, which
    `torch.distributed.checkpoint.state_dict` saves and loads as one
    FQN-keyed optimizer state dict.
    """

    def __init__(self, cfg: DictConfig, params, device: torch.device):
        params = list(params)
        self.optimizers = [build_optimizer(cfg, [p], device) for p in params]
        self.param_groups = [{**self.optimizers[0].param_groups[0], "params": params}]
        for p, optimizer in zip(params, self.optimizers):
            p.register_post_accumulate_grad_hook(_step_and_free(optimizer))

    def step(self, closure=None) -> None:
        """Every parameter was stepped in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient was freed by its parameter's hook."""


def _step_and_free(optimizer: torch.optim.Optimizer):
    def hook(param: torch.Tensor) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return hook


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (a plain scalar tensor, the same on
    every rank of a replica), scaling them to `max_norm` first when it is > 0.

    `torch.nn.utils.clip_grad_norm_` computes the same, but over DTensor
    gradients every foreach op is dispatched per parameter (~15 ms of a 77 ms
    step on an H100 for a 163M GPT). Here: one foreach norm over the local
    shards, one all-reduce of the sum of squares over the mesh dims the
    gradients are sharded on (none for DDP's plain tensors), one foreach scale.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [local_view(g) for g in grads]
    norms = torch._foreach_norm(local, 2.0)
    total = torch.stack([n.float() for n in norms]).square().sum()
    if isinstance(grads[0], DTensor):
        mesh = grads[0].device_mesh
        for dim, placement in enumerate(grads[0].placements):
            if placement.is_shard():
                dist.all_reduce(total, group=mesh.get_group(dim))
    norm = total.sqrt()
    if max_norm > 0:
        torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm
