"""Config schemas (registered with Hydra's ConfigStore) and the one `validate`.

Each config group has a dataclass per option, stored under `schema/<group>` so
the schemas never show up as selectable group options. A group's YAML file
pulls its schema in with `/schema/<group>/<name>@_here_`, which gives typos and
wrong types Hydra's own startup error. Hydra accepts `+group.new_key=...` on a
schema'd node without complaint (and `OmegaConf.to_object` silently drops it),
so `validate` also rejects keys that no schema declares.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import BooleanNode, DictConfig, OmegaConf, open_dict

from harness.checkpoint import CheckpointError, check_compatible, checkpoint_dir, complete_checkpoints, read_meta, resume_path
from harness.data import text_files
from harness.dist import resolve_device, under_torchrun
from harness.mesh import STRATEGIES, mesh_shape


class ConfigError(ValueError):
    """A config that cannot run; the message names key, value and fix."""


# --- launch / process settings --------------------------------------------------


@dataclass
class LauncherConf:
    # ranks `python train.py` starts itself (ignored under torchrun); null = one
    # per visible GPU when the ranks use CUDA, else 2
    nproc: Optional[int] = None
    # how they are started: auto = spawn when they use CUDA (a forked child cannot
    # use CUDA if its parent ever touched it), fork otherwise (0.3 s, not 2-3 s)
    start_method: str = "auto"  # auto | fork | spawn | forkserver


@dataclass
class DistConf:
    timeout_s: int = 600  # process-group timeout: a hung collective fails after this
    threads_per_rank: Optional[int] = None  # CPU threads per rank; null = cores / local ranks


@dataclass
class TrainConf:
    steps: int = 200
    batch_size: int = 8  # sequences per rank per step
    seq_len: int = 64
    seed: int = 0
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    nonfinite: str = "error"  # NaN/inf loss or gradients: error (stop) | skip (drop the step on every rank)
    compile: bool = False  # torch.compile each block (as torchtitan does)
    # peak dense bf16 TFLOP/s of one device, for train/mfu; null = looked up
    # from the GPU's name (harness.metrics.PEAK_TFLOPS), none on CPU
    peak_tflops: Optional[float] = None


# --- model ----------------------------------------------------------------------


@dataclass
class GPTConf:
    name: str = "gpt"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256


@dataclass
class MLPConf:
    name: str = "mlp"
    n_layer: int = 2
    d_model: int = 64
    hidden: int = 256
    vocab_size: int = 256


# --- data -----------------------------------------------------------------------


@dataclass
class SyntheticDataConf:
    name: str = "synthetic"
    noise: float = 0.1  # probability that a token breaks the learnable pattern


@dataclass
class TextDataConf:
    name: str = "text"
    root: Optional[str] = None  # null = the Python standard library's own sources
    glob: str = "**/*.py"
    max_bytes: int = 64 * 2**20  # stop reading files past this many bytes
    cache_dir: str = "~/.cache/harness"


# --- optimizer ------------------------------------------------------------------


@dataclass
class SGDConf:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    fused: Optional[bool] = None  # null = fused kernels on CUDA, the default (foreach) elsewhere


@dataclass
class AdamConf:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = 3e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: Optional[bool] = None  # null = fused kernels on CUDA, the default (foreach) elsewhere


@dataclass
class AdamWConf(AdamConf):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01


# --- averager -------------------------------------------------------------------


@dataclass
class NoAveragerConf:
    name: str = "none"


@dataclass
class PeriodicAveragerConf:
    name: str = "periodic"
    period: int = 4  # average parameters across replicas every `period` steps ...
    warmup_steps: int = 10  # ... after this many fully synchronous steps


@dataclass
class HierarchicalAveragerConf:
    name: str = "hierarchical"
    # [period, replicas per group] pairs: PyTorch's HierarchicalModelAverager
    # `period_group_size_dict` as a list, because Hydra merges a dict override
    # into the old dict instead of replacing it. At a step past warmup the
    # largest period dividing the step wins: [[2, 2], [8, 4]] averages pairs of
    # replicas every 2 steps and all 4 replicas every 8.
    period_group_size: List[List[int]] = field(default_factory=lambda: [[2, 2], [8, 4]])
    warmup_steps: int = 10


# --- sharding -------------------------------------------------------------------


@dataclass
class ShardingConf:
    strategy: str = "full_shard"
    # Replica count of the (replicate, shard) mesh. Only hybrid strategies take a
    # value (null: one replica per node, 2 on a single node); for the others null
    # means "what the strategy implies" (1 for full/grad-op sharding, world size
    # for no_shard and ddp).
    replicate: Optional[int] = None
    # compute dtype: FSDP2's mixed-precision params, autocast for ddp;
    # auto = bfloat16 on cuda, float32 on cpu
    param_dtype: str = "auto"
    reduce_dtype: str = "float32"  # auto = float32 too


# --- checkpoint / wandb ---------------------------------------------------------


@dataclass
class CheckpointConf:
    mode: str = "none"  # none | full | sharded
    interval: int = 100  # steps between checkpoints (and one at the last step)
    keep: int = 2  # complete checkpoints kept
    resume: str = "auto"  # auto (latest complete one in dir, if any) | never | <path>
    dir: Optional[str] = None  # null = <run dir>/checkpoints
    # + `async: bool = False` (sharded only: dcp.async_save), added by
    # `checkpoint_schema` because `async` is a Python keyword.


def checkpoint_schema() -> DictConfig:
    """CheckpointConf plus a typed `async` key, which no dataclass can declare.

    A BooleanNode gets the same Hydra errors as a dataclass field
    (`checkpoint.async=maybe` -> "Value 'maybe' is not a valid bool").
    """
    node = OmegaConf.structured(CheckpointConf)
    with open_dict(node):
        node["async"] = BooleanNode(False)
    return node


@dataclass
class WandbConf:
    mode: str = "offline"  # offline | online | disabled; WANDB_MODE wins when set
    project: str = "harness"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    init_timeout_s: float = 90.0  # W&B's own default; online without network falls back to offline after this


@dataclass
class Config:
    model: Any = None
    data: Any = None
    optimizer: Any = None
    averager: Any = None
    sharding: Any = None
    checkpoint: Any = None
    wandb: Any = None
    launcher: LauncherConf = field(default_factory=LauncherConf)
    dist: DistConf = field(default_factory=DistConf)
    train: TrainConf = field(default_factory=TrainConf)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    for group, schemas in {
        "model": {"gpt": GPTConf, "mlp": MLPConf},
        "data": {"synthetic": SyntheticDataConf, "text": TextDataConf},
        "optimizer": {"sgd": SGDConf, "adam": AdamConf, "adamw": AdamWConf},
        "averager": {"none": NoAveragerConf, "periodic": PeriodicAveragerConf,
                     "hierarchical": HierarchicalAveragerConf},
        "sharding": {"sharding": ShardingConf},
        "checkpoint": {"checkpoint": checkpoint_schema()},
        "wandb": {"wandb": WandbConf},
    }.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


# --- validation -----------------------------------------------------------------

DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("auto", "fork", "spawn", "forkserver")
NONFINITE = ("error", "skip")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WANDB_MODES = ("offline", "online", "disabled")
CHECKPOINT_MODES = ("none", "full", "sharded")
EXTRA_KEYS = {CheckpointConf: {"async"}}  # schema keys no dataclass field can carry (see checkpoint_schema)


def validate(cfg: DictConfig, world_size: int, gpus: int, run_dir: Path | None = None,
             local_world_size: int | None = None) -> None:
    """Check every cross-field rule before any process group exists.

    `gpus` is the number of CUDA devices visible on this node. Raises
    ConfigError with one paragraph per broken rule, each naming the key, its
    value and the fix. With `run_dir`, also checks the checkpoint the run
    would resume from (exists, complete, same model and optimizer).
    """
    errors = unknown_keys(cfg)
    errors += _check_train(cfg, world_size, gpus, local_world_size or world_size)
    errors += _check_model_and_data(cfg)
    errors += _check_optimizer(cfg.optimizer)
    errors += _check_sharding_and_averager(cfg, world_size, local_world_size)
    errors += _check_checkpoint_and_wandb(cfg)
    if run_dir is not None and not errors:
        errors += _check_resume(cfg, run_dir)
    if errors:
        raise ConfigError("\n\n".join(errors))


def config_warnings(cfg: DictConfig) -> list[str]:
    """Configs that run but probably not as meant (a short smoke run is a fair reason)."""
    avg = cfg.averager
    if avg.name != "none" and avg.warmup_steps >= cfg.train.steps:
        return [f"averager.warmup_steps={avg.warmup_steps} >= train.steps={cfg.train.steps}: every step is "
                "synchronous and the averager never averages. For local SGD lower averager.warmup_steps; for "
                "synchronous training say averager=none."]
    return []


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys present in a schema'd node that its dataclass does not declare."""
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
                    errors.append(
                        f"Unknown config key '{full}' (value {node._get_node(key)._value()!r}): "
                        f"'{path or 'config'}' is a {schema.__name__}, which has no key '{key}'. "
                        f"Valid keys: {', '.join(sorted(declared))}. Fix: check the spelling, "
                        f"and drop the '+' in '+{full}=...' (it adds keys instead of setting them)."
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
    for key, minimum in [("train.steps", 1), ("train.batch_size", 1), ("train.seq_len", 2),
                         ("train.log_every", 1), ("dist.timeout_s", 1)]:
        errors += _at_least(cfg, key, minimum, f"set {key}={max(minimum, 1)} or larger")
    errors += _at_least(cfg, "train.grad_clip", 0, "set train.grad_clip=0 to disable clipping")
    for key in ("launcher.nproc", "dist.threads_per_rank"):
        if OmegaConf.select(cfg, key) is not None:
            errors += _at_least(cfg, key, 1, f"set {key}=null (automatic) or a positive number")
    if cfg.train.peak_tflops is not None and cfg.train.peak_tflops <= 0:
        errors.append(f"train.peak_tflops={cfg.train.peak_tflops} must be positive (one device's peak dense "
                      "TFLOP/s). Fix: train.peak_tflops=null to look it up from the GPU's name.")
    if cfg.train.nonfinite not in NONFINITE:
        errors.append(f"train.nonfinite={cfg.train.nonfinite!r} is not one of {', '.join(NONFINITE)}. "
                      "Fix: train.nonfinite=error (stop) or train.nonfinite=skip.")
    if cfg.launcher.start_method not in START_METHODS:
        errors.append(f"launcher.start_method={cfg.launcher.start_method!r} is not one of "
                      f"{', '.join(START_METHODS)}. Fix: launcher.start_method=auto.")
    errors += _check_device(cfg, gpus, local_world_size)
    cpus = len(os.sched_getaffinity(0))
    if cfg.launcher.nproc is not None and cfg.launcher.nproc > 16 * cpus:
        errors.append(f"launcher.nproc={cfg.launcher.nproc} starts more than 16 ranks per CPU core "
                      f"({cpus} cores here); the run would thrash. Fix: launcher.nproc=2, or use torchrun across nodes.")
    return errors


def _check_device(cfg: DictConfig, gpus: int, local_world_size: int) -> list[str]:
    """A device that exists, and one GPU per local rank."""
    device = cfg.train.device
    if device not in DEVICES:
        return [f"train.device={device!r} is not one of {', '.join(DEVICES)}. Fix: train.device=auto."]
    if device == "cuda" and gpus == 0:
        return ["train.device=cuda but no CUDA device is visible on this machine. "
                "Fix: train.device=auto (cuda when present, else cpu) or train.device=cpu."]
    if resolve_device(device, gpus) != "cuda":
        return []
    if local_world_size > gpus:
        given = (f"launcher.nproc={local_world_size}" if not under_torchrun()
                 else f"torchrun --nproc-per-node {local_world_size}")
        fix = (f"launcher.nproc={gpus} (or launcher.nproc=null: one rank per GPU)" if not under_torchrun()
               else f"torchrun --nproc-per-node {gpus}")
        return [f"{given} starts {local_world_size} ranks on this node, but only {gpus} CUDA device(s) are "
                f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); each rank "
                f"needs a GPU of its own. Fix: {fix}, or train.device=cpu."]
    return []


def _check_model_and_data(cfg: DictConfig) -> list[str]:
    errors = []
    model, data = cfg.model, cfg.data
    for key in ("n_layer", "d_model", "vocab_size") + (("n_head",) if model.name == "gpt" else ("hidden",)):
        errors += _at_least(cfg, f"model.{key}", 1, f"set model.{key} to a positive integer")
    if model.name == "gpt" and model.n_head >= 1 and model.d_model % model.n_head:
        errors.append(f"model.d_model={model.d_model} is not divisible by model.n_head={model.n_head}. "
                      f"Fix: pick n_head dividing d_model, e.g. model.n_head={_divisor_near(model.d_model, model.n_head)}.")
    if data.name == "text":
        if model.vocab_size < 256:
            errors.append(f"model.vocab_size={model.vocab_size} is too small for data=text, which is byte-level "
                          "(256 symbols). Fix: model.vocab_size=256.")
        if data.root is not None and not os.path.isdir(os.path.expanduser(data.root)):
            errors.append(f"data.root={data.root!r} is not a directory. Fix: point data.root at a folder of "
                          "text files, or data.root=null for the Python standard library's sources.")
        elif not text_files(data):
            errors.append(f"data.glob={data.glob!r} matches no file under data.root={data.root!r}. "
                          "Fix: check the pattern ('**' recurses), e.g. data.glob='**/*.py'.")
    elif data.name == "synthetic" and not 0.0 <= data.noise < 1.0:
        errors.append(f"data.noise={data.noise} must be in [0, 1). Fix: data.noise=0.1.")
    return errors


def _check_resume(cfg: DictConfig, run_dir: Path) -> list[str]:
    """The checkpoint `checkpoint.resume` picks must exist, be complete and fit
    this model; and a run must not write over checkpoints it did not resume from."""
    path = resume_path(cfg.checkpoint, run_dir)
    root = checkpoint_dir(cfg.checkpoint, run_dir)
    existing = complete_checkpoints(root)
    if path is None:
        if existing and cfg.checkpoint.mode != "none":
            return [f"checkpoint.resume={cfg.checkpoint.resume} but {root} already holds checkpoints "
                    f"({', '.join(p.name for p in existing)}); this run would write over them. Fix: "
                    "checkpoint.resume=auto to continue from the latest, or a new hydra.run.dir / checkpoint.dir."]
        return []
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        return [str(e)]
    errors = check_compatible(meta, cfg, path)
    newer = [p.name for p in existing if int(p.name.split("_")[1]) > meta["step"]]
    if newer and cfg.checkpoint.mode != "none":
        errors.append(f"checkpoint.resume={str(path)!r} is step {meta['step']}, but {root} already holds later "
                      f"checkpoints ({', '.join(newer)}) that this run would write over. Fix: resume from the latest "
                      "(checkpoint.resume=auto), or save elsewhere (checkpoint.dir=<new folder>).")
    return errors


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), -d))


def _check_optimizer(opt: DictConfig) -> list[str]:
    target = opt.get("_target_")
    try:
        module, _, name = str(target).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return [f"optimizer._target_={target!r} cannot be imported. Fix: name an optimizer class, "
                "e.g. optimizer._target_=torch.optim.AdamW, or pick optimizer=sgd|adam|adamw."]
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        return [f"optimizer._target_={target!r} is not a torch.optim.Optimizer subclass. "
                "Fix: point it at an optimizer class such as torch.optim.SGD."]
    params = inspect.signature(cls).parameters
    errors = []
    for key in opt.keys():
        if str(key).startswith("_"):
            continue
        if key not in params:
            accepted = ", ".join(p for p in params if p not in ("self", "params"))
            errors.append(f"optimizer.{key}={opt[key]!r} is not an argument of {target}. "
                          f"It accepts: {accepted}. Fix: check the spelling of optimizer.{key}.")
    lr = opt.get("lr")
    if not isinstance(lr, (int, float)) or lr <= 0:
        errors.append(f"optimizer.lr={lr!r} must be a positive number. Fix: e.g. optimizer.lr=0.001.")
    return errors


def _check_sharding_and_averager(cfg: DictConfig, world_size: int, local_world_size: int | None) -> list[str]:
    shard, avg = cfg.sharding, cfg.averager
    errors = []
    if shard.strategy not in STRATEGIES:
        return [f"sharding.strategy={shard.strategy!r} is not one of {', '.join(STRATEGIES)}. "
                "Fix: pick a sharding=<strategy> group option."]
    for key in ("param_dtype", "reduce_dtype"):
        if shard[key] not in DTYPES:
            errors.append(f"sharding.{key}={shard[key]!r} is not one of {', '.join(DTYPES)}. Fix: sharding.{key}=auto.")
    if shard.strategy == "ddp" and shard.param_dtype == "float16":
        errors.append("sharding.param_dtype=float16 with sharding=ddp would autocast to float16 without a gradient "
                      "scaler, and small gradients underflow. Fix: sharding.param_dtype=bfloat16 (or auto).")
    if world_size < 1:  # launcher.nproc < 1, reported with the launcher's keys
        return errors
    try:
        replicate, _ = mesh_shape(shard.strategy, shard.replicate, world_size, local_world_size)
    except ValueError as e:
        return errors + [str(e)]
    if avg.name != "none":
        if avg.name == "periodic":
            errors += _at_least(cfg, "averager.period", 1, "averager.period=4 averages every 4 steps")
        errors += _at_least(cfg, "averager.warmup_steps", 0, "averager.warmup_steps=0 starts local SGD at once")
        if avg.name == "hierarchical" and replicate >= 2:
            errors += _check_hierarchy([list(pair) for pair in avg.period_group_size], replicate)
        if replicate < 2:
            fix = ("sharding=hybrid_shard sharding.replicate=2" if world_size >= 4 and world_size % 2 == 0
                   else "sharding=no_shard" if world_size >= 2 else "launcher.nproc=2 (or torchrun with 2+ ranks)")
            errors.append(
                f"averager={avg.name} averages parameters across replicas, but sharding={shard.strategy} at world "
                f"size {world_size} has {replicate} replica (mesh replicate={replicate}); inside a replica the ranks "
                f"hold different shards, so there is nothing to average. Fix: {fix}, or averager=none.")
    return errors


def _check_hierarchy(pairs: list[list[int]], replicas: int) -> list[str]:
    key = f"averager.period_group_size={pairs}".replace(" ", "")
    example = f"averager.period_group_size=[[2,2],[8,{replicas}]]" if replicas > 2 else "averager.period_group_size=[[4,2]]"
    if not pairs or any(len(pair) != 2 for pair in pairs):
        return [f"{key} must be a non-empty list of [period, group_size] pairs. Fix: e.g. {example}."]
    periods, sizes = [p for p, _ in pairs], [g for _, g in pairs]
    problems = []
    if any(p < 1 for p in periods) or periods != sorted(set(periods)):
        problems.append("periods (the first numbers) must be >= 1 and strictly increasing")
    if any(g < 1 or replicas % g for g in sizes):
        problems.append(f"every group size must divide the replica count {replicas}")
    elif any(b % a for a, b in zip(sizes, sizes[1:])):
        problems.append("each group size must divide the next (groups nest)")
    if sizes and sizes[-1] != replicas:
        problems.append(f"the largest period must average all {replicas} replicas (last group size = {replicas})")
    if problems:
        return [f"{key} is not a valid hierarchy: {'; '.join(problems)}. Fix: e.g. {example}."]
    return []


def _check_checkpoint_and_wandb(cfg: DictConfig) -> list[str]:
    errors = []
    ckpt = cfg.checkpoint
    if ckpt.mode not in CHECKPOINT_MODES:
        errors.append(f"checkpoint.mode={ckpt.mode!r} is not one of {', '.join(CHECKPOINT_MODES)}. "
                      "Fix: pick checkpoint=none|full|sharded.")
    if ckpt.mode != "none":
        errors += _at_least(cfg, "checkpoint.interval", 1, "checkpoint.interval=100")
        errors += _at_least(cfg, "checkpoint.keep", 1, "checkpoint.keep=2")
    if ckpt["async"] and ckpt.mode != "sharded":
        errors.append(f"checkpoint.async=true needs checkpoint=sharded (DCP's async_save), not checkpoint={ckpt.mode}. "
                      "Fix: checkpoint=sharded checkpoint.async=true, or checkpoint.async=false.")
    if cfg.wandb.mode not in WANDB_MODES:
        errors.append(f"wandb.mode={cfg.wandb.mode!r} is not one of {', '.join(WANDB_MODES)}. Fix: wandb.mode=offline.")
    return errors

