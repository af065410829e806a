"""The config checked against the world it will run in, before any rank starts:
`check_config` completes it (the architecture `model.init_from` names),
validates and preflights it, plans the run (`RunPlan`), and records in the
config what it decided, so the ranks and `.hydra/` see it."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness import fault_tolerance, resume
from harness.checkpoint import CheckpointError, read_meta
from harness.checkpoint_paths import run_resume_path
from harness.config import ConfigError, NoAveragerConf
from harness.dist import print_once, resolve_device, under_torchrun, visible_gpus
from harness.launch.logs import setup_logging
from harness.lr_schedules import depends_on_total_steps
from harness.mesh import HYBRID, mesh_shape
from harness.models.pretrained import adopt_init_from, adopt_saved_architecture, explicit_model_keys
from harness.plan import RunPlan, averager_configured, plan_run
from harness.preflight import preflight
from harness.validate import config_warnings, validate

log = logging.getLogger("harness")


def local_rank_count(cfg: DictConfig) -> int:
    """The ranks `python train.py` starts: `launcher.nproc`, or when null one per
    visible GPU when the ranks use CUDA (one when none is visible: `validate`
    then says that CUDA is missing, not that the rank count is wrong), else 2."""
    if cfg.launcher.nproc is not None:
        return cfg.launcher.nproc
    gpus = visible_gpus()
    return max(gpus, 1) if resolve_device(cfg.train.device, gpus) == "cuda" else 2


def start_method(cfg: DictConfig) -> str:
    """`launcher.start_method`; auto = spawn for CUDA ranks (a forked child cannot
    use CUDA once its parent has touched it, whoever did), fork otherwise."""
    if cfg.launcher.start_method != "auto":
        return str(cfg.launcher.start_method)
    return "spawn" if resolve_device(cfg.train.device, visible_gpus()) == "cuda" else "fork"


def check_config(cfg: DictConfig, world_size: int, local_world_size: int, run_dir: Path, rank: int) -> RunPlan:
    """Settle the config (`settle_config`), then on rank 0 set up logging and
    write `.hydra/`. Raises ConfigError (every broken rule) when it cannot run."""
    plan, warnings, notes = settle_config(cfg, world_size, local_world_size, run_dir, HydraConfig.get().overrides.task)
    setup_logging(run_dir, rank)
    if rank == 0:
        save_hydra_config(cfg, run_dir)
        for warning in warnings:
            log.warning("%s", warning)
        for note in notes:
            log.info("%s", note)
    return plan


def settle_config(
    cfg: DictConfig, world_size: int, local_world_size: int, run_dir: Path, overrides: list[str]
) -> tuple[RunPlan, list[str], list[str]]:
    """Complete the config (the architecture `model.init_from` names), validate,
    preflight and plan the run, and record in the config what it decided; returns
    the plan, warnings and notes for the log. `overrides`: the command line's."""
    note = train_one_replica_synchronously(cfg, world_size, local_world_size, overrides)
    loaded = model_from_init_from(cfg, run_dir, explicit_model_keys(overrides))
    validate(cfg, world_size, visible_gpus(), local_world_size)
    plan = plan_run(cfg, world_size, local_world_size, run_dir)
    if errors := preflight(cfg, run_dir, plan.resume_from):
        raise ConfigError("\n\n".join(errors))
    # the config records what the run derived: the local ranks it starts, the replicas of a hybrid mesh
    if not under_torchrun():
        cfg.launcher.nproc = world_size
    if cfg.sharding.strategy in HYBRID:
        cfg.sharding.replicate = plan.replicate
    warnings = ([note] if note else []) + config_warnings(cfg) + resume_warnings(cfg, plan)
    changed = resume.summary(read_meta(plan.resume_from), cfg, plan.resume_from) if plan.resume_from else None
    return plan, warnings, [n for n in (loaded, changed) if n]


def model_from_init_from(cfg: DictConfig, run_dir: Path, explicit: set[str]) -> str | None:
    """The model's architecture from `model.init_from`'s config.json (harness.models.pretrained), or on
    a resume from the checkpoint, whose run took it from there; returns what was read, for the log."""
    if cfg.model.get("init_from") is None:
        return None
    path = run_resume_path(cfg.checkpoint, run_dir, fault_tolerance.enabled(cfg))
    if path is None:
        return adopt_init_from(cfg.model, explicit)
    try:
        adopt_saved_architecture(cfg.model, read_meta(path)["model"], explicit)
    except (CheckpointError, KeyError, TypeError):
        pass  # preflight names what is wrong with the checkpoint
    return f"model.init_from is not read: the run resumes from {path}"


def resume_warnings(cfg: DictConfig, plan: RunPlan) -> list[str]:
    """A resume that silently changes the learning-rate curve still to run: the
    schedule is a function of `train.steps`, and the checkpoint's run had another."""
    if plan.resume_from is None or not depends_on_total_steps(cfg.lr_scheduler):
        return []
    saved = OmegaConf.select(OmegaConf.create(read_meta(plan.resume_from).get("config") or {}), "train.steps")
    if saved is None or saved == cfg.train.steps:
        return []
    return [
        f"train.steps={cfg.train.steps}, but the checkpoint at {plan.resume_from} was saved by a run of "
        f"train.steps={saved}; lr_scheduler._target_={cfg.lr_scheduler._target_} depends on it, so the steps "
        f"still to run follow the curve of {cfg.train.steps} steps, not the one the run began on. For that one "
        f"keep train.steps={saved}."
    ]


def nothing_to_train(cfg: DictConfig, plan: RunPlan) -> str | None:
    """Why the run has nothing to train (its checkpoint is at or past `train.steps`),
    said before any rank starts or W&B run opens; None when it has."""
    if plan.resume_from is None:
        return None
    step, steps = read_meta(plan.resume_from)["step"], cfg.train.steps
    if step < steps:
        return None
    if step == steps:
        return (
            f"already complete at step {step} of {steps}; nothing to train ({plan.resume_from}). To train on, "
            "raise train.steps; to start over, a new hydra.run.dir or checkpoint.resume=never."
        )
    return (
        f"the checkpoint at {plan.resume_from} is at step {step}, past train.steps={steps}; nothing to train. "
        f"To train on, train.steps above {step}."
    )


def refuse(error: ConfigError, world_size: int, rank: int) -> None:
    """Print why the config cannot run, once per job."""
    print_once(f"harness: the config cannot run (world size {world_size}):\n\n{error}", rank)


def train_one_replica_synchronously(
    cfg: DictConfig, world_size: int, local_world_size: int, overrides: list[str]
) -> str | None:
    """The default job on a layout with one replica (one GPU, one rank) has
    nothing to average: it trains synchronously instead of being refused, and
    says so. An averager or layout the user chose is left for `validate` to judge."""
    chosen = {o.lstrip("+~").split("=", 1)[0].split(".", 1)[0].split("/", 1)[0] for o in overrides}
    if not averager_configured(cfg) or chosen & {"averager", "method", "experiment", "sharding"}:
        return None
    try:
        replicate, _ = mesh_shape(cfg.sharding.strategy, cfg.sharding.replicate, world_size, local_world_size)
    except ValueError:
        return None  # validate names the problem
    if replicate > 1:
        return None
    cfg.averager = OmegaConf.structured(NoAveragerConf)
    return (
        f"one replica at world size {world_size} (sharding={cfg.sharding.strategy}): nothing to average, so this "
        "run trains synchronously (averager=none). For post-local SGD start 2 or more ranks (launcher.nproc=2, "
        "or torchrun with one rank per GPU)."
    )


def save_hydra_config(cfg: DictConfig, run_dir: Path) -> None:
    """`.hydra/` as Hydra writes it (config, hydra, overrides), once the config is known to run."""
    hydra_cfg = HydraConfig.get()
    out = run_dir / ".hydra"
    out.mkdir(exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, out / "overrides.yaml")
