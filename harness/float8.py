"""`train.float8`: the blocks' linears compute their matmuls in float8 through
torchao's float8 training (`torchao.float8`, the `float8` extra), as torchtitan
offers it.

`convert` swaps, on the meta-device model before it is compiled and sharded,
each `nn.Linear` inside `model.blocks` whose in and out features are multiples
of 16 (what float8 tensor cores take) for torchao's `Float8Linear`; the output
projection and anything else outside the blocks stay as they are (torchtitan
leaves `output` out, for the loss's stability). `Float8Linear` keeps its weight
a plain parameter in its own dtype, of the same name and shape, so the
optimizer state, averaging across replicas, checkpoints (which load either way
into a run without float8) and `harness.export` see what they would without it.

Recipes (`Float8LinearConfig.from_recipe_name`): `tensorwise`, one scale per
tensor; where FSDP2 shards a replica, its weights are all-gathered in float8
(`enable_fsdp_float8_all_gather`: half of bf16's bytes), each scale computed
from the whole weight. `rowwise`: a scale per row, more accurate, the
all-gather in the compute dtype. Float8 pays where the matmuls are large and the
casts fused, under `train.compile` (docs/gpu.md).

The weights' scales for a float8 all-gather are computed for all of them at
once, one all-reduce over the shard (`precompute_float8_dynamic_scale_for_fsdp`),
instead of one all-reduce per weight. torchao keeps a precomputed scale until
the next precompute, and here weights change outside the optimizer step too (a
resume, a heal, DiLoCo's delayed sync, steps inside backward), so the scales are
recomputed before every forward of the root (a root forward pre-hook) rather
than once after the optimizer step as torchtitan does: they always belong to
the weights the forward all-gathers. torchao's `force_recompute_fp8_weight_in_bwd`,
which torchtitan once set, is deprecated and does nothing in torchao 0.18
(pytorch/ao#2251; torchtitan dropped it): not set.

Hardware: float8 matmuls need a CUDA device of compute capability 8.9 or more
(Ada, Hopper, Blackwell); `validate` refuses others and the CPU. Tests alone
run the whole path on the CPU through torchao's emulation (`emulate=True`,
float8 values computed in high precision) with `HARNESS_TEST_FLOAT8_EMULATE=1`,
never a config key: a user never needs it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from harness.dist import resolve_device

log = logging.getLogger(__name__)

EMULATE_ENV = "HARNESS_TEST_FLOAT8_EMULATE"  # =1: torchao's emulated float8, on any device (tests only)
NEEDS_TORCHAO = 'Fix: pip install -e ".[float8]" (torchao), or train.float8=none.'
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
DIMENSION_MULTIPLE = 16  # float8 matmuls take in and out features that are multiples of 16


def emulated() -> bool:
    return os.environ.get(EMULATE_ENV) == "1"


def config_errors(cfg: DictConfig, gpus: int) -> list[str]:
    """Why `train.float8` cannot run here: torchao missing, or a device without float8 tensor cores; and a
    value of the test knob `HARNESS_TEST_FLOAT8_EMULATE` other than 1 or 0 (it would be ignored)."""
    knob = os.environ.get(EMULATE_ENV)
    if knob not in (None, "", "0", "1"):
        return [
            f"{EMULATE_ENV}={knob!r} (a test knob: torchao's emulated float8 on any device) takes 1 (emulate) or "
            f"0; any other value would be ignored. Fix: {EMULATE_ENV}=1, or unset {EMULATE_ENV}."
        ]
    recipe = cfg.train.float8
    if recipe == "none":
        return []
    key = f"train.float8={recipe}"
    try:
        _import_torchao_float8()
    except ImportError as e:
        return [f"{key} trains through torchao's float8 training, which does not import ({e}). {NEEDS_TORCHAO}"]
    if emulated():
        return []
    if resolve_device(cfg.train.device, gpus) != "cuda":
        return [
            f"{key}: the ranks run on the CPU, where float8 cannot pay: torch runs its float8 matmul there "
            "(torch._scaled_mm) without float8 units, slower than fp32's (1.35x at 1024 x 1024 x 1024, one thread, "
            "torch 2.13), and the casts come on top. Fix: run on a CUDA GPU of compute capability "
            f"{'.'.join(map(str, MIN_CAPABILITY))} or more (H100, H200, L4, L40S, RTX 4090, B200), or "
            "train.float8=none."
        ]
    return capability_errors(key, cuda_devices())


def capability_errors(key: str, devices: list[tuple[str, int, int]]) -> list[str]:
    """`devices`: (name, major, minor) of each visible GPU; one error naming those below float8's capability."""
    below = [
        f"{name} (compute capability {major}.{minor})"
        for name, major, minor in devices
        if (major, minor) < MIN_CAPABILITY
    ]
    if not below:
        return []
    return [
        f"{key}: {', '.join(below)} has no float8 tensor cores (compute capability "
        f"{'.'.join(map(str, MIN_CAPABILITY))} or more: Ada, Hopper, Blackwell). Fix: train.float8=none (bf16), "
        "or a GPU such as H100, H200, L4, L40S or B200."
    ]


def cuda_devices() -> list[tuple[str, int, int]]:
    """Name and compute capability of each visible GPU, asked in a process of its own: the process that
    validates and forks ranks must not initialise CUDA (harness.dist.visible_gpus). Empty if it fails
    (the ranks then say what is wrong)."""
    query = (
        "import json, torch; print(json.dumps([(torch.cuda.get_device_name(i), *torch.cuda.get_device_capability(i))"
        " for i in range(torch.cuda.device_count())]))"
    )
    proc = subprocess.run([sys.executable, "-c", query], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log.warning("could not read the GPUs' compute capability: %s", proc.stderr.strip()[-500:])
        return []
    return [tuple(device) for device in json.loads(proc.stdout.strip().splitlines()[-1])]


def config_warnings(cfg: DictConfig) -> list[str]:
    if cfg.train.float8 == "none" or cfg.train.compile:
        return []
    return [
        f"train.float8={cfg.train.float8} without train.compile=true: each float8 cast and scale runs as kernels "
        "of its own, so the step is likely slower than in bf16; float8 pays compiled, where they fuse. "
        "For speed add train.compile=true."
    ]


@contextmanager
def torchao_quieted():
    """torchao's loggers and torch's pytree logger quieted while torchao imports: on import it loads its
    compiled kernels, warning for each that does not load (all of them on a CPU-only torch), none of which
    float8 training uses (its matmul is torch._scaled_mm), and registers enums that torch 2.13 deprecates
    registering. Neither is the user's to act on. transformers imports torchao where it is installed (building
    or loading a model: `model=hf`, `harness.generate`), so those are quieted too."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _import_torchao_float8():
    """torchao.float8, imported quietly (`torchao_quieted`)."""
    with torchao_quieted():
        import torchao.float8
    return torchao.float8


def convert(model: nn.Module, recipe: str, fsdp: bool) -> None:
    """Swap the blocks' float8-sized linears of the meta-device `model` for `Float8Linear` (recipe
    `train.float8`); `fsdp`: FSDP2 will shard it (tensorwise weights are then all-gathered in float8, their
    scales computed before each forward). Logs what it converted and what it left."""
    if recipe == "none":
        return
    float8 = _import_torchao_float8()
    all_gather = fsdp and recipe == "tensorwise"
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(str(recipe)),  # a plain str: torchao checks its type
        enable_fsdp_float8_all_gather=all_gather,
        emulate=emulated(),
    )
    if recipe == "rowwise":  # torchtitan's workaround for pytorch/pytorch#150859 (rowwise scales under inductor)
        torch._inductor.config.emulate_precision_casts = True
    in_blocks = {id(m) for block in model.blocks for m in block.modules()}
    converted, too_small, outside = [], [], []

    def takes(module: nn.Module, fqn: str) -> bool:
        if id(module) not in in_blocks:
            outside.append(fqn)
            return False
        if module.in_features % DIMENSION_MULTIPLE or module.out_features % DIMENSION_MULTIPLE:
            too_small.append(fqn)
            return False
        converted.append(fqn)
        return True

    float8.convert_to_float8_training(model, config=config, module_filter_fn=takes)
    left = [f"{len(outside)} outside the blocks ({', '.join(outside)})"] if outside else []
    if too_small:
        left.append(f"{len(too_small)} whose features are not multiples of {DIMENSION_MULTIPLE} (e.g. {too_small[0]})")
    log.info(
        "float8 %s%s: %d linears converted; %s left in the compute dtype%s",
        recipe,
        " (emulated)" if config.emulate else "",
        len(converted),
        "; ".join(left) or "none",
        "; weights all-gathered in float8" if all_gather else "",
    )
    if all_gather:
        model.register_forward_pre_hook(_precompute_scales, prepend=True)


def _precompute_scales(model: nn.Module, args) -> None:
    """The float8 all-gather's weight scales, all in one all-reduce, for the weights as they are now."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_tensors(state):
    """`state` (nested dicts and lists) with each float8 weight's local shard as the tensor it wraps.

    Where FSDP2 all-gathers a weight in float8, its local shard is torchao's WeightWithDynamicFloat8CastTensor,
    a wrapper around the high-precision tensor. Written as is, DCP pickles the wrapper (a checkpoint only a
    process with torchao can read), and an async save's stager copies the wrapper's own storage, which holds
    nothing: the checkpoint held uninitialised memory (2e24 and zeros; its resume's loss was NaN).
    Checkpoints write and read the wrapped tensor instead, which shares its storage (a load in place lands in
    the weight): a plain tensor in its dtype, the same as a run without float8 holds.
    """
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:  # no float8 weight in this process
        return state
    wrapper = fsdp_utils.WeightWithDynamicFloat8CastTensor

    def unwrap(value):
        if isinstance(value, DTensor) and isinstance(value.to_local(), wrapper):
            local = value.to_local()._tensor
            return DTensor.from_local(
                local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
            )
        return value._tensor if isinstance(value, wrapper) else value

    return tree_map(unwrap, state)
