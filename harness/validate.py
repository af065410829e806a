"""The cross-field rules: `validate` checks a composed config against the
world it will run in, before any process group exists, and raises one
ConfigError listing every broken rule, each naming the key, its value and the
fix. Pure: it reads no file (that is `harness.preflight`).

Single-field rules are the schema's (`harness.config`: types and enums, Hydra's
own errors at composition); a component's own arguments are checked by the
component (its class accepts the keys; its constructor refuses bad values),
which `validate` asks by building it cheaply (models on the meta device).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness import fault_tolerance, float8, lr_schedules, sinks, slowdown
from harness.components import target_class
from harness.config import EXTRA_KEYS, ConfigError, ProfileConf, Strategy
from harness.data import data_source
from harness.dist import resolve_device, under_torchrun
from harness.mesh import mesh_shape
from harness.models import HARNESS_KEYS as MODEL_HARNESS_KEYS
from harness.models import build_model
from harness.optim import FUSED_ON_DTENSORS, HARNESS_KEYS
from harness.plan import averager_configured
from harness.sharding import one_device_replica


def validate(cfg: DictConfig, world_size: int, gpus: int, local_world_size: int | None = None) -> None:
    """Raise ConfigError with one paragraph per broken rule; `gpus` is the
    number of CUDA devices visible on this node."""
    errors = unknown_keys(cfg)
    errors += _check_train(cfg, world_size, gpus, local_world_size or world_size)
    errors += _check_model_and_data(cfg)
    errors += _check_optimizer(cfg.optimizer)
    errors += _check_lr_scheduler(cfg)
    errors += _check_in_backward(cfg)
    errors += _check_sharding_and_averager(cfg, world_size, local_world_size)
    errors += _check_checkpoint(cfg)
    errors += sinks.config_errors(cfg)
    if errors:
        raise ConfigError("\n\n".join(errors))


def config_warnings(cfg: DictConfig) -> list[str]:
    """Configs that run but probably not as meant (a short smoke run, or a preset's settings kept while
    one part is switched off, is a fair reason)."""
    avg, warnings = cfg.averager, []
    if averager_configured(cfg) and cfg.train.steps <= avg.get("warmup_steps", 0):
        warnings.append(
            f"averager.warmup_steps={avg.warmup_steps} >= train.steps={cfg.train.steps}: every step is "
            "synchronous and the averager never averages. For local SGD lower averager.warmup_steps; for "
            "synchronous training say averager=none."
        )
    return warnings + _profile_warnings(cfg) + float8.config_warnings(cfg)


def _profile_warnings(cfg: DictConfig) -> list[str]:
    """`train.profile` settings that record nothing: a run that ends before the first window does, or
    window keys set while the profiler is off."""
    profile = cfg.train.profile
    if not profile.enabled:
        defaults = ProfileConf()
        keys = [f.name for f in dataclasses.fields(ProfileConf) if f.name != "enabled"]
        changed = [f"train.profile.{k}={profile[k]}" for k in keys if profile[k] != getattr(defaults, k)]
        if not changed:
            return []
        return [
            f"{', '.join(changed)} set, but train.profile.enabled=false: no profiler runs and nothing is traced. "
            "Fix: train.profile.enabled=true, or drop those keys."
        ]
    window = profile.wait + profile.warmup + profile.active
    if window <= cfg.train.steps:
        return []
    return [
        f"train.profile: the first window ends at step wait + warmup + active = {profile.wait} + {profile.warmup} + "
        f"{profile.active} = {window}, after the run's last, train.steps={cfg.train.steps}, so no trace is written. "
        f"Fix: train.profile.wait={max(0, cfg.train.steps - profile.warmup - profile.active)} (or fewer warmup and "
        "active steps), or more train.steps."
    ]


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys present in a schema'd node that its dataclass does not declare.

    Hydra accepts `+group.new_key=...` on a schema'd node without complaint
    (and `OmegaConf.to_object` silently drops it), so it is refused here.
    """
    from harness.overrides import closest

    errors = []

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, DictConfig):
            return
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            declared = {f.name for f in dataclasses.fields(schema)} | EXTRA_KEYS.get(schema, set())
            for key in node.keys():
                if key not in declared:
                    full = f"{path}.{key}" if path else str(key)
                    value = node._get_node(key)._value()
                    typo = closest(str(key), sorted(declared))
                    plus = f"drop the '+' in '+{full}=...', which adds keys instead of setting them"
                    fix = (
                        f"{full[: -len(str(key))]}{typo}={value} (the closest key; {plus})"
                        if typo
                        else f"check the spelling, and {plus}"
                    )
                    other_keys = getattr(schema, "OTHER_KEYS", None)  # a schema that takes no keys says why
                    errors.append(
                        f"Unknown config key '{full}' (value {value!r}): {other_keys.format(key=full)}"
                        if other_keys is not None
                        else f"Unknown config key '{full}' (value {value!r}): "
                        f"'{path or 'config'}' is a {schema.__name__}, which has no key '{key}'. "
                        f"Valid keys: {', '.join(sorted(declared))}. Fix: {fix}."
                    )
        for key in node.keys():
            if not OmegaConf.is_missing(node, key):
                walk(node._get_node(key), f"{path}.{key}" if path else str(key))

    walk(cfg, "")
    return errors


def _at_least(cfg: DictConfig, key: str, minimum: float, fix: str) -> list[str]:
    value = OmegaConf.select(cfg, key)
    if value is None or value < minimum:
        return [f"{key}={value} is out of range: it must be >= {minimum}. Fix: {fix}."]
    return []


def _check_train(cfg: DictConfig, world_size: int, gpus: int, local_world_size: int) -> list[str]:
    errors = []
    for key, minimum in [
        ("train.steps", 1),
        ("train.batch_size", 1),
        ("train.grad_accum", 1),
        ("train.seq_len", 2),
        ("train.log_every", 1),
        ("dist.timeout_s", 1),
    ]:
        errors += _at_least(cfg, key, minimum, f"set {key}={max(minimum, 1)} or larger")
    errors += _at_least(cfg, "train.grad_clip", 0, "set train.grad_clip=0 to disable clipping")
    errors += _at_least(cfg, "train.eval_every", 0, "train.eval_every=0 (no eval pass) or e.g. 100")
    batches = cfg.train.eval_batches
    if batches != "all" and (type(batches) is not int or batches < 1):  # checked with eval off too: it may be on later
        quoted = isinstance(batches, str) and batches.strip().isdigit()  # '4': a number in quotes, a string
        shown = f"{batches!r} (a string)" if quoted else batches
        fix = f"{batches.strip()} without quotes" if quoted else "4"
        errors.append(
            f"train.eval_batches={shown} is neither a number of batches (at least 1) nor 'all'. Fix: "
            f"train.eval_batches={fix} (spread over the held-out split), or train.eval_batches=all (every window)."
        )
    for key in ("launcher.nproc", "dist.threads_per_rank"):
        if OmegaConf.select(cfg, key) is not None:
            errors += _at_least(cfg, key, 1, f"set {key}=null (automatic) or a positive number")
    if cfg.train.peak_tflops is not None and not 0 < cfg.train.peak_tflops < math.inf:
        errors.append(
            f"train.peak_tflops={cfg.train.peak_tflops} must be positive (one device's peak dense "
            "TFLOP/s). Fix: train.peak_tflops=null to look it up from the GPU's name."
        )
    errors += _check_device(cfg, gpus, local_world_size)
    errors += float8.config_errors(cfg, gpus)
    errors += _check_profile(cfg, gpus)
    cpus = len(os.sched_getaffinity(0))
    if cfg.launcher.nproc is not None and cfg.launcher.nproc > 16 * cpus:
        errors.append(
            f"launcher.nproc={cfg.launcher.nproc} starts more than 16 ranks per CPU core "
            f"({cpus} cores here); the run would thrash. Fix: launcher.nproc=2, or use torchrun across nodes."
        )
    return errors


def _check_profile(cfg: DictConfig, gpus: int) -> list[str]:
    profile = cfg.train.profile
    errors = []
    for key, minimum in (("wait", 0), ("warmup", 0), ("active", 1), ("repeat", 0), ("keep", 1)):
        errors += _at_least(cfg, f"train.profile.{key}", minimum, f"train.profile.{key}={max(minimum, 1)}")
    if profile.memory_snapshot and resolve_device(cfg.train.device, gpus) != "cuda":
        errors.append(
            "train.profile.memory_snapshot=true records CUDA's allocator, but the ranks run on the CPU here. "
            "Fix: train.profile.memory_snapshot=false (the trace still shows where the time goes), or run on a GPU."
        )
    return errors


def _check_device(cfg: DictConfig, gpus: int, local_world_size: int) -> list[str]:
    """A device that exists, and one GPU per local rank."""
    if cfg.train.device == "cuda" and gpus == 0:
        return [
            "train.device=cuda but no CUDA device is visible on this machine. "
            "Fix: train.device=auto (cuda when present, else cpu) or train.device=cpu."
        ]
    if resolve_device(cfg.train.device, gpus) != "cuda" or local_world_size <= gpus:
        return []
    torchrun = under_torchrun()
    given = f"torchrun --nproc-per-node {local_world_size}" if torchrun else f"launcher.nproc={local_world_size}"
    fix = (
        f"torchrun --nproc-per-node {gpus}"
        if torchrun
        else f"launcher.nproc={gpus} (or launcher.nproc=null: one rank per GPU)"
    )
    return [
        f"{given} starts {local_world_size} ranks on this node, but only {gpus} CUDA device(s) are "
        f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); each rank "
        f"needs a GPU of its own. Fix: {fix}, or train.device=cpu."
    ]


def _check_model_and_data(cfg: DictConfig) -> list[str]:
    """The model and the data source accept their keys and values: each is built
    (the model on the meta device; sources are cheap until `open()`)."""
    errors = []
    model_cls, model_errors = target_class(
        cfg.model, "model", torch.nn.Module, "torch.nn.Module", ("seq_len",), "gpt|mlp|llama|hf", MODEL_HARNESS_KEYS
    )
    data_cls, data_errors = target_class(
        cfg.data, "data", object, "data source", ("vocab_size", "seed"), "synthetic|text|tokens"
    )
    errors += model_errors + data_errors
    if model_cls is not None:
        try:
            build_model(cfg.model, cfg.train.seq_len)
        except ValueError as e:
            errors.append(str(e))
    if data_cls is not None:
        try:
            source = data_source(cfg)
        except ValueError as e:
            errors.append(str(e))
        else:
            if hasattr(source, "eval_errors"):
                errors += source.eval_errors(cfg.train.eval_every, cfg.train.eval_batches)
    return errors


def _check_optimizer(opt: DictConfig) -> list[str]:
    _, errors = target_class(
        opt, "optimizer", torch.optim.Optimizer, "torch.optim.Optimizer", ("params",), "sgd|adam|adamw", HARNESS_KEYS
    )
    lr = opt.get("lr")
    if not isinstance(lr, (int, float)) or lr <= 0:
        errors.append(f"optimizer.lr={lr!r} must be a positive number. Fix: e.g. optimizer.lr=0.001.")
    return errors


def _check_lr_scheduler(cfg: DictConfig) -> list[str]:
    _, errors = target_class(
        cfg.lr_scheduler,
        "lr_scheduler",
        torch.optim.lr_scheduler.LRScheduler,
        "torch.optim.lr_scheduler.LRScheduler",
        ("optimizer", "total_steps"),
        "constant|warmup_cosine|wsd|step",
    )
    return errors + lr_schedules.config_errors(cfg)


def _check_in_backward(cfg: DictConfig) -> list[str]:
    """optimizer.in_backward steps each parameter the moment its gradient is ready:
    nothing may need all gradients first, and the gradient must be final there."""
    if not cfg.optimizer.get("in_backward"):
        return []
    errors = []
    if cfg.train.grad_clip > 0:
        errors.append(
            f"optimizer.in_backward=true with train.grad_clip={cfg.train.grad_clip}: clipping needs the norm of all "
            "gradients before any parameter steps, but in backward each parameter steps as soon as its own gradient "
            "is ready. Fix: train.grad_clip=0, or optimizer.in_backward=false."
        )
    if cfg.train.nonfinite == "skip":
        errors.append(
            "optimizer.in_backward=true with train.nonfinite=skip: a step can only be skipped before it is taken, "
            "and in backward the parameters have stepped before the loss and gradients can be checked. "
            "Fix: train.nonfinite=error (stops before averaging and saving), or optimizer.in_backward=false."
        )
    if cfg.train.grad_accum > 1:
        errors.append(
            f"optimizer.in_backward=true with train.grad_accum={cfg.train.grad_accum}: in backward each parameter "
            "steps as soon as its gradient is ready, so it would step on every micro-batch's partial gradient "
            "instead of once on their sum. Fix: train.grad_accum=1 (a larger train.batch_size), or "
            "optimizer.in_backward=false."
        )
    if cfg.sharding.strategy == Strategy.ddp:
        errors.append(
            "optimizer.in_backward=true with sharding=ddp: DDP all-reduces gradients after autograd has "
            "accumulated them, so a per-parameter hook would step on the unreduced gradient, and PyTorch's own "
            "in-backward path for DDP installs its own communication hook, which cannot be combined with the "
            "averagers' hooks. Fix: sharding=no_shard (DDP's layout: a replica per rank, its gradients reduced by "
            "the harness, one parameter at a time), another strategy, or "
            "optimizer.in_backward=false."
        )
    return errors


def _check_sharding_and_averager(cfg: DictConfig, world_size: int, local_world_size: int | None) -> list[str]:
    shard, avg = cfg.sharding, cfg.averager
    errors = []
    if world_size < 1:  # launcher.nproc < 1, reported with the launcher's keys
        return errors
    try:
        replicate, shard_size = mesh_shape(shard.strategy, shard.replicate, world_size, local_world_size)
    except ValueError as e:
        return errors + [str(e)]
    fsdp2 = shard.strategy != Strategy.ddp and not one_device_replica(shard, shard_size)
    optimizer = cfg.optimizer.get("_target_")
    if fsdp2 and cfg.optimizer.get("fused") and optimizer not in FUSED_ON_DTENSORS:
        errors.append(
            f"optimizer.fused=true with {optimizer} on FSDP2 (sharding={shard.strategy}, {shard_size} ranks per "
            "replica): torch has no fused kernel of it for sharded (DTensor) parameters, only Adam's and AdamW's. "
            "Fix: optimizer.fused=null (fused wherever it runs), or a layout with a replica per rank "
            "(sharding=no_shard)."
        )
    if shard.param_dtype == "float16":  # every layout alike: FSDP2's mixed precision, ddp's and one device's autocast
        errors.append(
            f"sharding.param_dtype=float16 (sharding={shard.strategy}) would compute in float16 without a gradient "
            "scaler, which the harness has not, and small gradients underflow. Fix: sharding.param_dtype=bfloat16 "
            "(or auto)."
        )
    errors += fault_tolerance.config_errors(cfg, replicate) + slowdown.config_errors(
        replicate, averager_configured(cfg)
    )
    errors += slowdown.exchange_delay_errors(averager_configured(cfg) and replicate >= 2)
    if not averager_configured(cfg):
        return errors
    # the clock asks an averager class its `schedule`, the loop its `before_step`: a ReplicaAverager's
    from harness.averaging import SCHEDULE_KEYS, ReplicaAverager

    averager_cls, target_errors = target_class(
        avg,
        "averager",
        ReplicaAverager,
        "harness.averaging.ReplicaAverager",
        ("mesh", "traffic", "clock", "model", "link"),
        "none|periodic|hierarchical|diloco",
        SCHEDULE_KEYS,
    )
    errors += target_errors
    if replicate < 2:
        fix = (
            "sharding=hybrid_shard sharding.replicate=2"
            if world_size >= 4 and world_size % 2 == 0
            else "sharding=no_shard"
            if world_size >= 2
            else "launcher.nproc=2 (or torchrun with 2+ ranks)"
        )
        errors.append(
            f"averager._target_={avg._target_} averages parameters across replicas, but sharding={shard.strategy} "
            f"at world size {world_size} has {replicate} replica (mesh replicate={replicate}); inside a replica the "
            f"ranks hold different shards, so there is nothing to average. Fix: {fix}, or averager=none."
        )
    elif averager_cls is not None and hasattr(averager_cls, "config_errors"):
        errors += averager_cls.config_errors(cfg, replicate)
    if averager_cls is not None:
        errors += _averager_state_errors(avg._target_, averager_cls)
    return errors


CHECKPOINT_PART_METHODS = ("state_dict", "load_state_dict", "tensor_state_dict", "load_tensor_state_dict")


def _averager_state_errors(target: str, cls: type) -> list[str]:
    """A checkpoint saves an averager's state only through its `checkpoint_part`:
    state methods on the averager itself would silently never be called."""
    own = [name for name in CHECKPOINT_PART_METHODS if hasattr(cls, name)]
    if not own:
        return []
    return [
        f"averager._target_={target} defines {', '.join(own)}, which a checkpoint never calls: an averager's "
        "state is saved only through its `checkpoint_part` property (None, or an object with state_dict/"
        "load_state_dict for meta.json and tensor_state_dict/load_tensor_state_dict for tensors, as DiLoCo's "
        f"OuterState). Fix: move {', '.join(own)} onto such an object and return it from checkpoint_part."
    ]


def _check_checkpoint(cfg: DictConfig) -> list[str]:
    errors = []
    ckpt = cfg.checkpoint
    if ckpt.mode != "none":
        errors += _at_least(cfg, "checkpoint.interval", 1, "checkpoint.interval=100")
        errors += _at_least(cfg, "checkpoint.keep", 1, "checkpoint.keep=2")
    if ckpt["async"] and ckpt.mode != "sharded":
        errors.append(
            f"checkpoint.async=true needs checkpoint=sharded (DCP's async_save), not checkpoint={ckpt.mode}. "
            "Fix: checkpoint=sharded checkpoint.async=true, or checkpoint.async=false."
        )
    return errors
