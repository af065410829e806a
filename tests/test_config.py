"""Config composition and every `validate` rule (in-process, no torch.distributed)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.averaging import ReplicaAverager
from harness.checkpoint import resume_path
from harness.config import ConfigError, plain, register_configs
from harness.dist import visible_gpus
from harness.launch import local_rank_count
from harness.launch.check import nothing_to_train, resume_warnings, train_one_replica_synchronously
from harness.mesh import mesh_shape
from harness.models import build_model
from harness.plan import plan_run
from harness.preflight import preflight
from harness.validate import validate

from support import REPO, checkpoint_meta, make

register_configs()
CONF = REPO / "conf"
GROUPS = ["model", "data", "optimizer", "lr_scheduler", "averager", "sharding", "checkpoint", "fault_tolerance"]
GROUPS += ["wandb", "averager/outer_optimizer"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_into_its_schema_and_every_key_has_a_resume_rule(group, option):
    """Each option is typed by its schema, and every key of the config it composes declares what a resume
    does when it changed (harness/config.py's RESUME, read by harness/resume.py): a new key without a rule
    fails here."""
    from harness.resume import leaves

    chosen = [f"{group}={option}"] + (["averager=diloco"] if group.startswith("averager/") else [])
    cfg = make(*chosen, *([] if group.startswith("averager") else ["averager=none"]))
    node = OmegaConf.select(cfg, group.replace("/", "."))
    assert OmegaConf.get_type(node).__name__.endswith("Conf"), f"{group}={option} has no schema"
    OmegaConf.to_object(node)  # every value converts to its declared type
    assert [key for key, rule in leaves(cfg) if rule is None] == []


def test_every_schema_declares_a_rule_for_each_key_and_none_for_a_key_it_has_not():
    from harness.resume import keys_of, rules_of, schemas

    for section, schema in schemas():
        keys, covered = keys_of(schema), {key.split(".")[0] for key in rules_of(schema)}
        nested = {f.name for f in dataclasses.fields(schema) if dataclasses.is_dataclass(f.default_factory)}
        assert keys - covered - nested == set(), (section, schema.__name__)  # a nested schema: its own rules
        assert covered - keys == set(), (section, schema.__name__)


def test_default_config_is_valid_at_two_ranks_and_takes_averager_period():
    validate(make(), world_size=2, gpus=0)
    cfg = make("averager.period=4")
    validate(cfg, world_size=2, gpus=0)
    assert cfg.averager.period == 4 and cfg.launcher.nproc is None
    assert local_rank_count(cfg) == (visible_gpus() or 2)  # one rank per GPU, else 2
    assert cfg.launcher.nproc is None  # the user's value: the launcher records the count once the config passes


def test_mission_configs_are_valid():
    validate(make("optimizer=sgd", "averager.period=4"), world_size=2, gpus=0)
    validate(make("sharding=hybrid_shard", "sharding.replicate=2", "optimizer=adamw"), world_size=4, gpus=0)


@pytest.mark.parametrize(
    "overrides,error",
    [
        (["averager.perod=4"], "Key 'perod' not in 'PeriodicAveragerConf'"),
        (["averager.warmup_steps=abc"], "could not be converted to Integer"),
        (["train.stepz=3"], "Key 'stepz' not in 'TrainConf'"),
        (["optimizer=sgdd"], "Could not find 'optimizer/sgdd'"),
        (["checkpoint=sharded", "checkpoint.async=maybe"], "Value 'maybe' is not a valid bool"),
        (["checkpoint.asnyc=true"], "Key 'asnyc' not in 'CheckpointConf'"),
        # allowed values are enums in the schema: stated once, enforced by OmegaConf
        (["train.device=tpu"], "Invalid value 'tpu', expected one of [auto, cpu, cuda]"),
        (["train.nonfinite=sometimes"], "Invalid value 'sometimes', expected one of [error, skip]"),
        (["launcher.start_method=thread"], "Invalid value 'thread', expected one of [auto, fork, spawn, forkserver]"),
        (
            ["sharding.reduce_dtype=float8"],
            "Invalid value 'float8', expected one of [auto, float32, bfloat16, float16]",
        ),
        (["sharding.strategy=zero3"], "Invalid value 'zero3', expected one of [full_shard, shard_grad_op"),
        (["checkpoint.mode=sometimes"], "Invalid value 'sometimes', expected one of [none, full, sharded]"),
        (["wandb.mode=loud"], "Invalid value 'loud', expected one of [offline, online, disabled]"),
        (
            ["averager.comm_dtype=float16"],
            "Invalid value 'float16', expected one of [float32, bfloat16, int8, float8_e4m3fn]",
        ),
        (["averager=diloco", "averager.outer_device=gpu"], "Invalid value 'gpu', expected one of [device, cpu]"),
    ],
)
def test_hydra_rejects_typos_and_wrong_types_at_composition(overrides, error):
    with pytest.raises(Exception) as info:
        make(*overrides)
    chain = f"{info.value}\n{info.value.__cause__}"  # Hydra wraps OmegaConf's message
    assert error in chain, chain


def test_schemas_are_not_listed_as_group_options():
    with pytest.raises(Exception) as info:
        make("averager=nope")
    listed = str(info.value).split("Available options")[1].split("Config search path")[0]
    assert "periodic" in listed and "schema" not in listed


# (overrides, world size, visible GPUs, substrings the error must contain)
RULES = [
    (["+averager.perod=4"], 2, 0, ["averager.perod", "PeriodicAveragerConf", "Valid keys", "drop the '+'"]),
    (["averager=none", "+averager.balance=time"], 2, 0, ["averager=none trains synchronously", "averager=periodic"]),
    (["+train.stepz=3"], 2, 0, ["train.stepz", "TrainConf"]),
    (["train.steps=0"], 2, 0, ["train.steps=0", ">= 1"]),
    (["train.batch_size=-1"], 2, 0, ["train.batch_size=-1", ">= 1"]),
    (["train.seq_len=1"], 2, 0, ["train.seq_len=1", ">= 2"]),
    (["train.log_every=0"], 2, 0, ["train.log_every=0"]),
    (["train.grad_clip=-1"], 2, 0, ["train.grad_clip=-1.0", "train.grad_clip=0"]),
    (["train.device=cuda"], 2, 0, ["train.device=cuda", "no CUDA device is visible", "train.device=cpu"]),
    (
        ["train.device=cuda", "launcher.nproc=4"],
        4,
        2,
        ["launcher.nproc=4 starts 4 ranks", "only 2 CUDA device(s)", "Fix: launcher.nproc=2", "train.device=cpu"],
    ),
    (["launcher.nproc=2"], 2, 1, ["launcher.nproc=2 starts 2 ranks", "only 1 CUDA device(s)"]),  # auto picks cuda
    (["train.peak_tflops=0"], 2, 0, ["train.peak_tflops=0", "train.peak_tflops=null"]),
    (["launcher.nproc=0"], 2, 0, ["launcher.nproc=0"]),
    (["launcher.nproc=100000"], 2, 0, ["launcher.nproc=100000", "thrash"]),
    (["dist.timeout_s=0"], 2, 0, ["dist.timeout_s=0"]),
    (["dist.threads_per_rank=0"], 2, 0, ["dist.threads_per_rank=0", "null"]),
    (["model.n_head=3"], 2, 0, ["model.d_model=128", "model.n_head=3", "model.n_head=4"]),
    (["model.n_layer=0"], 2, 0, ["model.n_layer=0"]),
    (
        ["model.n_positions=32"],
        2,
        0,
        ["train.seq_len=64 is longer than model.n_positions=32", "Fix: train.seq_len=32", "model.n_positions=null"],
    ),
    (["model.activation=relu"], 2, 0, ["model.activation='relu'", "Fix: model.activation=gelu", "gelu_new"]),
    (["model=llama", "model.d_model=100", "model.n_heads=8"], 2, 0, ["model.d_model=100", "model.n_heads=10"]),
    (["model=llama", "model.n_kv_heads=3"], 2, 0, ["model.n_heads=4", "model.n_kv_heads=3", "model.n_kv_heads=4"]),
    (["model=llama", "model.d_model=12"], 2, 0, ["model.d_model=12", "heads 3 wide", "model.d_model=16"]),
    (
        ["model=llama3_1b", "model.rope_scaling.rope_type=yarn"],
        2,
        0,
        ["model.rope_scaling.rope_type='yarn'", "rope_type llama3", "Fix: model=hf"],
    ),
    (
        ["model=hf", "+model.config_overrides.num_hiden_layers=3"],
        2,
        0,
        ["LlamaConfig has no key 'num_hiden_layers'", "Fix: model.config_overrides.num_hidden_layers=..."],
    ),
    (["model=llama3_8b", "~model.rope_scaling.factor"], 2, 0, ["lacks factor", "Llama 3.1: 8.0, 1.0, 4.0, 8192"]),
    (["model=llama3_8b", "model.rope_scaling.high_freq_factor=1"], 2, 0, ["high_freq_factor above low_freq_factor"]),
    (["data.noise=1.5"], 2, 0, ["data.noise=1.5", "[0, 1)"]),
    (["data=text", "model.vocab_size=100"], 2, 0, ["model.vocab_size=100", "byte-level", "model.vocab_size=256"]),
    (["+optimizer.momentm=0.9"], 2, 0, ["optimizer.momentm=0.9", "torch.optim.SGD", "momentum"]),
    (["optimizer.lr=0"], 2, 0, ["optimizer.lr=0", "positive"]),
    (["optimizer._target_=torch.optim.Nope"], 2, 0, ["optimizer._target_='torch.optim.Nope'", "cannot be imported"]),
    (["optimizer._target_=torch.nn.Linear"], 2, 0, ["torch.nn.Linear", "not a torch.optim.Optimizer"]),
    (["sharding=hybrid_shard", "sharding.replicate=3"], 4, 0, ["sharding.replicate=3", "world size 4", "[1, 2, 4]"]),
    (["train.grad_accum=0"], 2, 0, ["train.grad_accum=0 is out of range"]),
    (
        ["optimizer.in_backward=true", "train.grad_clip=0", "train.grad_accum=2"],
        2,
        0,
        ["train.grad_accum=2", "would step on every micro-batch"],
    ),
    (
        ["lr_scheduler=warmup_cosine", "lr_scheduler.warmup_steps=500"],
        2,
        0,
        ["lr_scheduler.warmup_steps=500 must be in [1, train.steps=200]", "Fix: lr_scheduler.warmup_steps=20"],
    ),
    (["lr_scheduler=wsd", "lr_scheduler.min_lr_ratio=2"], 2, 0, ["min_lr_ratio=2", "above the peak"]),
    (["lr_scheduler=wsd", "lr_scheduler.decay_fraction=0.95"], 2, 0, ["warmup_steps=20 runs into the decay"]),
    (["lr_scheduler=step", "lr_scheduler.milestones=[150,100]"], 2, 0, ["milestones=[150, 100]", "increasing"]),
    (["lr_scheduler=step", "lr_scheduler.milestones=[100,300]"], 2, 0, ["[1, train.steps=200]"]),
    (["lr_scheduler._target_=torch.optim.SGD"], 2, 0, ["not a torch.optim.lr_scheduler.LRScheduler subclass"]),
    (
        ["data=text", "data.eval_fraction=0", "train.eval_every=5"],
        2,
        0,
        ["train.eval_every=5 scores held-out data, but data.eval_fraction=0", "Fix: data.eval_fraction=0.01"],
    ),
    (
        ["sharding=full_shard", "sharding.replicate=2"],
        4,
        0,
        ["sharding.replicate=2 conflicts with sharding=full_shard"],
    ),
    (
        ["sharding=ddp", "sharding.param_dtype=float16"],
        2,
        0,
        ["sharding.param_dtype=float16 (sharding=ddp)", "gradient scaler", "sharding.param_dtype=bfloat16"],
    ),
    (  # a replica of one rank autocasts as ddp does
        ["sharding=no_shard", "sharding.param_dtype=float16"],
        2,
        0,
        ["sharding.param_dtype=float16 (sharding=no_shard)", "gradient scaler"],
    ),
    (  # FSDP2's mixed precision computed in fp16 without a scaler, silently
        ["sharding=full_shard", "averager=none", "sharding.param_dtype=float16"],
        2,
        0,
        ["sharding.param_dtype=float16 (sharding=full_shard)", "gradient scaler", "sharding.param_dtype=bfloat16"],
    ),
    (
        ["optimizer=sgd", "optimizer.fused=true", "sharding=full_shard", "averager=none"],
        2,
        0,
        ["optimizer.fused=true with torch.optim.SGD on FSDP2", "Fix: optimizer.fused=null"],
    ),
    (["train.profile.active=0"], 2, 0, ["train.profile.active=0 is out of range", "Fix: train.profile.active=1"]),
    (["train.profile.memory_snapshot=true"], 2, 0, ["records CUDA's allocator", "memory_snapshot=false"]),
    (
        ["sharding=full_shard"],
        4,
        0,
        [
            "averager._target_=harness.averaging.ReplicaAverager averages parameters",
            "1 replica",
            "sharding=hybrid_shard sharding.replicate=2",
            "averager=none",
        ],
    ),
    (["sharding=full_shard"], 2, 0, ["averages parameters across replicas", "Fix: sharding=no_shard"]),
    (["sharding=no_shard"], 1, 0, ["averages parameters across replicas", "launcher.nproc=2"]),
    (["averager.period=0"], 2, 0, ["averager.period=0", ">= 1"]),
    (["averager.warmup_steps=-1"], 2, 0, ["averager.warmup_steps=-1", ">= 0"]),
    (
        ["averager=hierarchical", "sharding=no_shard"],
        2,
        0,
        [
            "averager.period_group_size=[[2,2],[8,4]]",
            "divide the replica count 2",
            "averager.period_group_size=[[4,2]]",
        ],
    ),
    (
        ["averager=hierarchical", "sharding=no_shard", "averager.period_group_size=[[8,4],[2,2]]"],
        4,
        0,
        ["strictly increasing", "last group size = 4"],
    ),
    (
        ["averager=hierarchical", "sharding=no_shard", "averager.period_group_size=[[2,2],[8,2]]"],
        4,
        0,
        ["the largest period must average all 4 replicas"],
    ),
    (
        ["averager=hierarchical", "sharding=no_shard", "averager.period_group_size=[[2,2],[4,3],[8,6]]"],
        6,
        0,
        ["each group size must divide the next"],
    ),
    (
        ["averager=hierarchical", "sharding=no_shard", "averager.period_group_size=[[2]]"],
        4,
        0,
        ["list of [period, group_size] pairs"],
    ),
    (["averager=hierarchical", "sharding=full_shard"], 4, 0, ["HierarchicalReplicaAverager", "1 replica"]),
    (["averager=diloco", "sharding=full_shard"], 2, 0, ["DiLoCoAverager averages", "1 replica", "sharding=no_shard"]),
    (
        ["averager=diloco", "averager.fragments=3"],
        2,
        0,
        ["averager.fragments=3 does not divide averager.period=16", "[1, 2, 4, 8, 16]"],
    ),
    (["averager=diloco", "averager.fragments=8"], 2, 0, ["averager.fragments=8 exceeds the model's 4 blocks"]),
    (["averager=diloco", "averager.fragments=0"], 2, 0, ["averager.fragments=0", ">= 1"]),
    (
        ["averager=diloco", "averager.outer_optimizer._target_=torch.nn.Linear"],
        2,
        0,
        ["averager.outer_optimizer._target_='torch.nn.Linear' is not a torch.optim.Optimizer", "sgd|nesterov|adamw"],
    ),
    (
        ["averager=diloco", "averager.outer_optimizer.lr=0"],
        2,
        0,
        ["averager.outer_optimizer.lr=0", "lr=0.85 (the default)"],
    ),
    (["averager=diloco", "averager.period=0"], 2, 0, ["averager.period=0"]),
    (["train.eval_every=-1"], 2, 0, ["train.eval_every=-1", "train.eval_every=0"]),
    (["optimizer.in_backward=true"], 2, 0, ["train.grad_clip=1.0", "Fix: train.grad_clip=0"]),
    (
        ["optimizer.in_backward=true", "train.grad_clip=0", "train.nonfinite=skip"],
        2,
        0,
        ["train.nonfinite=skip", "Fix: train.nonfinite=error"],
    ),
    (["optimizer.in_backward=true", "train.grad_clip=0", "sharding=ddp"], 2, 0, ["sharding=ddp", "unreduced"]),
    (
        ["averager=diloco", "averager.outer_optimizer.in_backward=true"],
        2,
        0,
        ["averager.outer_optimizer.in_backward=true", "steps at syncs"],
    ),
    (
        ["sharding=no_shard", "averager._target_=test_config.StateDictAverager"],
        2,
        0,
        ["defines state_dict, load_state_dict, which a checkpoint never calls", "return it from checkpoint_part"],
    ),
    (["train.eval_every=10", "train.eval_batches=0"], 2, 0, ["train.eval_batches=0", "train.eval_batches=all"]),
    (["train.eval_every=10", "train.eval_batches=every"], 2, 0, ["train.eval_batches=every", "nor 'all'"]),
    (["train.eval_every=10", "train.eval_batches=true"], 2, 0, ["train.eval_batches=True", "nor 'all'"]),
    (["train.eval_every=10", "train.eval_batches=all"], 2, 0, ["data=synthetic's held-out stream is endless"]),
    (["data=text", "data.eval_fraction=1.0"], 2, 0, ["data.eval_fraction=1.0", "[0, 1)"]),
    (["checkpoint=sharded", "checkpoint.interval=0"], 2, 0, ["checkpoint.interval=0"]),
    (["checkpoint=full", "checkpoint.keep=0"], 2, 0, ["checkpoint.keep=0"]),
    (
        ["checkpoint=full", "checkpoint.async=true"],
        2,
        0,
        ["checkpoint.async=true needs checkpoint=sharded", "Fix: checkpoint=sharded checkpoint.async=true"],
    ),
]


class StateDictAverager(ReplicaAverager):
    """State on the averager itself, not on its `checkpoint_part`: a checkpoint would never save it."""

    def state_dict(self) -> dict:
        return {"seen": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["seen"]


@pytest.mark.parametrize("overrides,world_size,gpus,expected", RULES, ids=[" ".join(r[0]) + f"@{r[1]}" for r in RULES])
def test_validate_names_key_value_and_fix(overrides, world_size, gpus, expected):
    if "optimizer" in overrides[0] and "momentm" in overrides[0]:
        overrides = ["optimizer=sgd", *overrides]
    with pytest.raises(ConfigError) as info:
        validate(make(*overrides), world_size=world_size, gpus=gpus)
    message = str(info.value)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"
    assert "Fix:" in message


def test_valid_hierarchies_pass():
    validate(make("averager=hierarchical", "sharding=no_shard"), world_size=4, gpus=0)
    validate(
        make(
            "averager=hierarchical",
            "sharding=hybrid_shard",
            "sharding.replicate=4",
            "averager.period_group_size=[[4,2],[16,4]]",
        ),
        world_size=8,
        gpus=0,
    )


def test_a_comm_dtype_the_torch_build_lacks_is_refused():
    """The rule validate asks of every averager, given a dtype name this build lacks
    (float8_e4m3fn on a build without float8 types reads the same)."""
    from harness.averaging.config_rules import periodic_errors

    cfg = make("averager=diloco", "averager.comm_dtype=int8")
    assert periodic_errors(cfg, replicas=2) == []
    cfg.averager = OmegaConf.merge(OmegaConf.to_container(cfg.averager), {"comm_dtype": "float8_e3m4"})
    (error,) = periodic_errors(cfg, replicas=2)
    assert "averager.comm_dtype=float8_e3m4" in error and "has no torch.float8_e3m4" in error
    assert "Fix: averager.comm_dtype=int8" in error


def test_validate_reports_every_broken_rule_at_once():
    with pytest.raises(ConfigError) as info:
        validate(make("train.steps=0", "averager.period=0"), world_size=2, gpus=0)
    assert "train.steps=0" in str(info.value) and "averager.period=0" in str(info.value)


def test_any_torch_optim_class_is_one_yaml_file_away(tmp_path):
    import torch

    from harness.optim import build_optimizer

    (tmp_path / "optimizer").mkdir()
    (tmp_path / "optimizer" / "rmsprop.yaml").write_text(
        "_target_: torch.optim.RMSprop\n_partial_: true\nlr: 0.01\nalpha: 0.9\n"
    )
    cfg = make(f"hydra.searchpath=[file://{tmp_path}]", "optimizer=rmsprop")
    validate(cfg, world_size=2, gpus=0)
    optimizer = build_optimizer(cfg.optimizer, torch.nn.Linear(2, 2).parameters(), torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.RMSprop) and optimizer.defaults["alpha"] == 0.9
    with pytest.raises(ConfigError, match="optimizer.alpah=0.9 is not an argument of torch.optim.RMSprop"):
        validate(
            make(f"hydra.searchpath=[file://{tmp_path}]", "optimizer=rmsprop", "+optimizer.alpah=0.9"),
            world_size=2,
            gpus=0,
        )


def test_checkpoint_async_is_a_typed_key():
    cfg = make("checkpoint=sharded", "checkpoint.async=true")
    validate(cfg, world_size=2, gpus=0)
    assert cfg.checkpoint["async"] is True


def fake_checkpoint(step_dir, step: int, **meta):
    import json

    step_dir.mkdir(parents=True)
    base = checkpoint_meta(step, model=OmegaConf.to_container(make().model), optimizer="torch.optim.AdamW")
    (step_dir / "meta.json").write_text(json.dumps({**base, **meta}))
    return step_dir


def validate_and_preflight(cfg, run_dir) -> None:
    """What `python train.py` checks before any rank starts."""
    validate(cfg, world_size=2, gpus=0)
    if errors := preflight(cfg, run_dir, resume_path(cfg.checkpoint, run_dir)):
        raise ConfigError("\n\n".join(errors))


PREFLIGHT_RULES = [
    (["data=text", "data.glob=**/*.nothing-matches"], ["data.glob='**/*.nothing-matches'", "matches no file"]),
    (["data=text", "data.root=/no/such/dir"], ["data.root='/no/such/dir'", "not a directory"]),
    (
        ["checkpoint=full", "checkpoint.dir=/proc/nope"],
        ["checkpoint.dir='/proc/nope' cannot be created or written", "checkpoint.dir=<a folder you can write to>"],
    ),
]


@pytest.mark.parametrize("overrides,expected", PREFLIGHT_RULES, ids=[" ".join(r[0]) for r in PREFLIGHT_RULES])
def test_preflight_checks_files_and_names_the_fix(overrides, expected, tmp_path):
    cfg = make(*overrides)
    validate(cfg, world_size=2, gpus=0)  # nothing wrong before the file system is asked
    with pytest.raises(ConfigError) as info:
        validate_and_preflight(cfg, tmp_path / "run")
    for text in expected:
        assert text in str(info.value), f"{text!r} not in:\n{info.value}"
    assert "Fix:" in str(info.value)


RESUME_RULES = [
    ("missing", ["checkpoint.resume={root}/nowhere"], ["no such file or directory", "nowhere"]),
    ("no meta", ["checkpoint.resume={root}/run/checkpoints/step_3"], ["is not a complete checkpoint", "meta.json"]),
    ("corrupt meta", ["checkpoint.resume={root}/corrupt"], ["meta.json is unreadable", "corrupt"]),
    (
        "other model",
        ["checkpoint.resume={root}/ok/step_5", "model.d_model=64"],
        ["holds another model", "model.d_model: saved 128, configured 64"],
    ),
    (
        "other optimizer",
        ["checkpoint.resume={root}/ok/step_5", "optimizer=sgd"],
        ["saved with optimizer._target_='torch.optim.AdamW', this run has 'torch.optim.SGD'", "Fix: optimizer=adamw"],
    ),
    (
        "would overwrite",
        ["checkpoint=sharded", "checkpoint.resume=never", "checkpoint.dir={root}/ok"],
        ["already holds checkpoints (step_5, step_9)", "this run would write over them"],
    ),
    (
        "older than dir",
        ["checkpoint=sharded", "checkpoint.resume={root}/ok/step_5", "checkpoint.dir={root}/ok"],
        ["is step 5", "later checkpoints (step_9)"],
    ),
]


@pytest.mark.parametrize("name,overrides,expected", RESUME_RULES, ids=[r[0] for r in RESUME_RULES])
def test_resume_checks_name_the_path_and_the_fix(name, overrides, expected, tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_3").mkdir(parents=True)  # a save that never finished
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "meta.json").write_text("{not json")
    fake_checkpoint(tmp_path / "ok" / "step_5", 5)
    fake_checkpoint(tmp_path / "ok" / "step_9", 9)
    cfg = make(*(o.format(root=tmp_path) for o in overrides))
    with pytest.raises(ConfigError) as info:
        validate_and_preflight(cfg, tmp_path / "run")
    for text in expected:
        assert text in str(info.value), f"{text!r} not in:\n{info.value}"
    assert "Fix:" in str(info.value)


SCHEDULE_RESUMES = [  # (lr_scheduler, train.steps of the resumed run, whether it warns, replica groups' checkpoints)
    ("warmup_cosine", 60, True, False),
    ("wsd", 60, True, False),
    ("warmup_cosine", 40, False, False),  # the same length
    ("constant", 60, False, False),  # not a function of the length
    ("warmup_cosine", 60, True, True),  # fault_tolerance=torchft: each group's own, the furthest counts
    ("constant", 40, False, True),
]


@pytest.mark.parametrize(
    "schedule,steps,warns,groups",
    SCHEDULE_RESUMES,
    ids=[f"{s}-{n}" + ("-groups" if g else "") for s, n, _, g in SCHEDULE_RESUMES],
)
def test_a_resume_that_changes_the_schedules_length_warns_and_a_finished_run_has_nothing_to_train(
    schedule, steps, warns, groups, tmp_path
):
    run = tmp_path / "run"
    ft = ["fault_tolerance=torchft", "sharding=no_shard"] if groups else []
    if groups:  # group 1 is behind (it died late and was not healed before the run ended)
        fake_checkpoint(run / "replica_group_1" / "checkpoints" / "step_24", 24, config={"train": {"steps": 40}})
    fake_checkpoint(
        run / ("replica_group_0" if groups else "") / "checkpoints" / "step_40", 40, config={"train": {"steps": 40}}
    )
    cfg = make(f"lr_scheduler={schedule}", f"train.steps={steps}", "checkpoint=sharded", *ft)
    plan = plan_run(cfg, 2, 2, run)
    warnings = resume_warnings(cfg, plan)
    if warns:
        [warning] = warnings
        assert "train.steps=60" in warning and "train.steps=40" in warning and "keep train.steps=40" in warning
    else:
        assert warnings == []
    done = nothing_to_train(cfg, plan)
    assert (done is None) == (steps > 40)
    if steps == 40:
        assert done.startswith("already complete at step 40 of 40; nothing to train")
    less = make(f"lr_scheduler={schedule}", "train.steps=30", "checkpoint=sharded", *ft)
    assert "at step 40, past train.steps=30; nothing to train" in nothing_to_train(less, plan_run(less, 2, 2, run))


def test_resume_auto_picks_the_latest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = make("checkpoint=sharded")
    assert resume_path(cfg.checkpoint, run) is None
    fake_checkpoint(run / "checkpoints" / "step_10", 10)
    fake_checkpoint(run / "checkpoints" / "step_9", 9)
    (run / "checkpoints" / "step_12.partial").mkdir()
    (run / "checkpoints" / "step_11").mkdir()  # no meta.json: not complete
    assert resume_path(cfg.checkpoint, run) == run / "checkpoints" / "step_10"
    validate_and_preflight(cfg, run)
    cfg = make("checkpoint=sharded", f"checkpoint.resume={run / 'checkpoints'}")  # a folder: its latest
    assert resume_path(cfg.checkpoint, run) == run / "checkpoints" / "step_10"


def test_warmup_past_the_last_step_and_a_profiler_that_traces_nothing_warn_but_run():
    from harness.validate import config_warnings

    cfg = make("train.steps=8")  # the default warmup is 10
    validate(cfg, world_size=2, gpus=0)
    [warning] = config_warnings(cfg)
    assert "averager.warmup_steps=10 >= train.steps=8" in warning and "averager=none" in warning
    assert config_warnings(make()) == [] and config_warnings(make("averager=none", "train.steps=8")) == []
    # the profiler's first window (5 + 2 + 3 steps) ends after the run: profile/ stayed empty
    [warning] = config_warnings(make("averager=none", "train.steps=8", "train.profile.enabled=true"))
    assert "ends at step wait + warmup + active = 5 + 2 + 3 = 10" in warning and "train.steps=8" in warning
    assert "Fix: train.profile.wait=3" in warning
    # its keys set without enabling it: ignored before
    [warning] = config_warnings(make("train.profile.wait=95", "train.profile.repeat=0"))
    assert "train.profile.wait=95, train.profile.repeat=0 set, but train.profile.enabled=false" in warning
    assert config_warnings(make("train.profile.enabled=true", "train.profile.wait=95", "train.steps=200")) == []


def test_cuda_without_a_gpu_is_one_error_about_the_device_not_the_derived_rank_count():
    """`launcher.nproc=null` becomes one rank per GPU; with none visible that count is derived,
    not the user's mistake, so only the device is reported."""
    if visible_gpus():
        pytest.skip("a GPU is visible here")
    cfg, world = make("train.device=cuda"), local_rank_count(make("train.device=cuda"))
    train_one_replica_synchronously(cfg, world, world, ["train.device=cuda"])  # as the launcher does first
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=world, gpus=0)
    assert str(info.value).startswith("train.device=cuda but no CUDA device is visible")
    assert "launcher.nproc" not in str(info.value) and "\n\n" not in str(info.value)


@pytest.mark.parametrize(
    "world,local,replicas", [(1, 1, 1), (3, 3, 1), (2, 2, 2), (4, 4, 2), (4, 2, 2), (8, 2, 4), (16, 8, 2)]
)
def test_hybrid_replicas_default_to_one_per_node(world, local, replicas):
    """sharding.replicate=null: one replica per node (shard within, average across nodes); on one
    node 2 when its ranks split evenly, else 1 (one GPU)."""
    cfg = make("sharding=hybrid_shard", "averager=none")
    assert cfg.sharding.replicate is None
    validate(cfg, world_size=world, gpus=0, local_world_size=local)
    assert mesh_shape("hybrid_shard", None, world, local) == (replicas, world // replicas)


def make_with_hydra(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("preset", options("experiment"))
def test_experiment_presets_define_their_own_sweep_and_run(preset):
    cfg = make_with_hydra(f"experiment={preset}")
    assert cfg.hydra.sweeper.params, f"experiment={preset} sweeps nothing"
    assert preset in cfg.hydra.sweep.dir  # the sweep dir (and so the W&B group) names the experiment
    keys = list(cfg.hydra.sweeper.params)
    for values in itertools.product(*(str(v).split(",") for v in cfg.hydra.sweeper.params.values())):
        job = make(f"experiment={preset}", *(f"{k}={v}" for k, v in zip(keys, values)))
        validate(job, world_size=2, gpus=0)


def test_slurm_launcher_composes_one_task_per_job_with_a_gpu_per_rank():
    cfg = make_with_hydra("hydra/launcher=slurm", "launcher.nproc=8")
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (1, 1, 8)


def _schema_defaults(schema) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(schema))


def _repeated_defaults(values: dict, defaults: dict, prefix: str = "") -> list[str]:
    repeats = []
    for key, value in values.items():
        default = defaults.get(key, "<not in schema>")
        if isinstance(value, dict) and isinstance(default, dict):
            repeats += _repeated_defaults(value, default, f"{prefix}{key}.")
        elif value == default:
            repeats.append(f"{prefix}{key}: {value!r}")
    return repeats


# Folders of conf/ the check below leaves out, each with the reason (docs/configuration.md says the same).
NOT_CHECKED_FOR_REPEATS = {
    "hydra/launcher": "Hydra's submitit plugin options: their defaults are the plugin's, not harness/config.py's, "
    "and slurm.yaml pins what the harness relies on (one node, one task per job) whatever the plugin's defaults",
}


def test_yaml_files_hold_only_what_an_option_changes():
    """Every default is stated once: a YAML value equal to the value it would have
    without it is a second copy that would silently win over the schema. Every
    YAML under conf/ is compared (but the folders in NOT_CHECKED_FOR_REPEATS):

    - an option built on `/schema/<group>/<name>` (a group option, an outer
      optimizer) against that schema's defaults;
    - a `# @package _global_` preset (conf/experiment/, conf/method/) against the
      config it changes: the default config with the preset's defaults-list
      overrides applied (`override /averager: diloco` -> `averager=diloco`, so a
      method is compared with its averager's YAML and schema); `hydra:` is Hydra's;
    - conf/config.yaml's (conf/prepare.yaml's) own values against the root schema (PrepareConf).
    A method named `<averager>_<period>` may leave its period to the schema; that
    it still composes to the period its name states is checked here too."""
    from harness.config import SCHEMAS, Config, PrepareConf

    found, unchecked = {}, []
    for path in sorted(CONF.rglob("*.yaml")):
        relative = path.relative_to(CONF)
        if str(relative.parent) in NOT_CHECKED_FOR_REPEATS:
            continue
        values = OmegaConf.to_container(OmegaConf.load(path))
        defaults = values.pop("defaults", [])
        schema_refs = [d for d in defaults if isinstance(d, str) and d.startswith("/schema/")]
        if str(relative) in ("config.yaml", "prepare.yaml"):
            values.pop("hydra", None)
            root = Config if str(relative) == "config.yaml" else PrepareConf
            found[str(relative)] = _repeated_defaults(values, _schema_defaults(root))
        elif schema_refs:
            _, _, group, name = schema_refs[0].split("@")[0].split("/")
            found[str(relative)] = _repeated_defaults(values, _schema_defaults(SCHEMAS[group][name]))
        elif path.read_text().startswith("# @package _global_"):
            choices = [
                f"{key.removeprefix('override /')}={value}"
                for entry in defaults
                if isinstance(entry, dict)
                for key, value in entry.items()
            ]
            values.pop("hydra", None)
            found[str(relative)] = _repeated_defaults(values, OmegaConf.to_container(make(*choices)))
        else:
            unchecked.append(str(relative))
    assert not unchecked, f"no rule says what these YAML files are compared with: {unchecked}"
    assert len(found) > 30
    repeats = {path: r for path, r in found.items() if r}
    assert not repeats, f"YAML files repeat defaults (harness/config.py, or the option a preset selects): {repeats}"

    for path in sorted((CONF / "method").glob("*_*.yaml")):
        period = path.stem.rsplit("_", 1)[1]
        if period.isdigit():
            assert make(f"+method={path.stem}").averager.period == int(period), f"method={path.stem}"


def test_config_and_report_do_not_load_torch_distributed():
    code = (
        "import sys, harness.config, harness.report; "
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]", out


def module_imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The harness modules `name` (at `path`) imports: every import statement in it, those under
    `if TYPE_CHECKING:` and inside functions included (an import moved there to dodge a cycle still is
    one), with the packages they run (`from harness.a.b import c` runs harness/a/__init__.py)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    parts = {".".join(t.split(".")[:i]) for t in found for i in range(1, t.count(".") + 2)}
    # a module's own packages are being imported already when it runs: no edge
    return {m for m in parts & modules if not (name == m or name.startswith(f"{m}."))}


def test_the_package_has_no_import_cycles():
    paths = {}
    for path in (REPO / "harness").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: module_imports(name, path, set(paths)) for name, path in paths.items()}
    cycles = []
    for start in sorted(graph):  # a cycle through `start`: a path from one of its imports back to it
        seen, stack = set(), [(m, [start, m]) for m in sorted(graph[start])]
        while stack:
            module, trail = stack.pop()
            if module == start:
                cycles.append(" -> ".join(trail))
                break
            if module not in seen:
                seen.add(module)
                stack += [(m, [*trail, m]) for m in sorted(graph[module])]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_a_new_model_is_a_class_and_a_yaml_file(tmp_path):
    """Like an optimizer: `_target_` names the class, its arguments are checked
    against the constructor, its own rules come from the constructor."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "wide_mlp.yaml").write_text(
        "_target_: harness.models.TokenMLP\nn_layer: 1\nd_model: 32\nhidden: 512\nvocab_size: 256\n"
    )
    cfg = make(f"hydra.searchpath=[file://{tmp_path}]", "model=wide_mlp")
    validate(cfg, world_size=2, gpus=0)
    assert type(build_model(cfg.model, cfg.train.seq_len)).__name__ == "TokenMLP"
    with pytest.raises(ConfigError, match="model.hiden=512 is not an argument of harness.models.TokenMLP"):
        validate(
            make(f"hydra.searchpath=[file://{tmp_path}]", "model=wide_mlp", "~model.hidden", "+model.hiden=512"),
            world_size=2,
            gpus=0,
        )
    with pytest.raises(ConfigError, match=r"model.n_layer=0 out of range"):
        validate(
            make(f"hydra.searchpath=[file://{tmp_path}]", "model=wide_mlp", "model.n_layer=0"), world_size=2, gpus=0
        )


@pytest.mark.parametrize(
    "override,fix",
    [
        ("+train.stepz=3", "Fix: train.steps=3 (the closest key; drop the '+' in '+train.stepz=...'"),
        ("+averager.perod=4", "Fix: averager.period=4 (the closest key; drop the '+' in '+averager.perod=...'"),
        ("+train.xyz=3", "Fix: check the spelling, and drop the '+' in '+train.xyz=...'"),
    ],
)
def test_an_added_unknown_key_names_the_closest_key(override, fix):
    with pytest.raises(ConfigError) as info:
        validate(make(override), world_size=2, gpus=0)
    assert fix in str(info.value), info.value


# -- weight-decay groups across a resume (check_compatible) -------------------------


def saved_meta(*overrides: str, old: bool = False) -> dict:
    """What check_compatible reads from meta.json of a checkpoint saved by a run
    of `overrides`. `old`: saved before `decay_1d` existed, when every optimizer
    had one group, decay on every parameter: the same config without the key,
    as the harness then wrote it (no other optimizer key has changed since)."""
    cfg = make(*overrides)
    meta = {"model": OmegaConf.to_container(cfg.model), "optimizer": cfg.optimizer._target_, "config": plain(cfg)}
    if old:
        for opt in (meta["config"]["optimizer"], meta["config"]["averager"].get("outer_optimizer")):
            if opt:
                del opt["decay_1d"]
    return meta


OUTER_ADAMW = ["averager=diloco", "averager/outer_optimizer=adamw"]
DECAY_RESUMES = [  # (id, saved by, old checkpoint?, resumed with, texts of the refusal or None: it resumes)
    ("old, new default", [], True, [], ["saved before decay_1d existed", "Fix: optimizer.decay_1d=true to continue"]),
    ("old, decay_1d=true", [], True, ["optimizer.decay_1d=true"], None),
    ("old sgd, no decay", ["optimizer=sgd"], True, ["optimizer=sgd"], None),
    ("new, decay_1d=true", [], False, ["optimizer.decay_1d=true"], ["on matrices only", "optimizer.decay_1d=false"]),
    ("new, same", [], False, [], None),
    ("no decay, decay set", ["optimizer.weight_decay=0"], False, [], ["Fix: optimizer.weight_decay=0.0 to continue"]),
    ("decay, none set", [], False, ["optimizer.weight_decay=0"], ["Fix: optimizer.weight_decay=0.01 to continue"]),
    (
        "old outer adamw",
        OUTER_ADAMW,
        True,
        [*OUTER_ADAMW, "optimizer.decay_1d=true"],
        ["averager.outer_optimizer.weight_decay=0.01 on every parameter", "outer_optimizer.decay_1d=true"],
    ),
    ("old outer nesterov", ["averager=diloco"], True, ["averager=diloco", "optimizer.decay_1d=true"], None),
]


@pytest.mark.parametrize(
    "saved_by,old,resumed_with,expected", [r[1:] for r in DECAY_RESUMES], ids=[r[0] for r in DECAY_RESUMES]
)
def test_a_resume_keeps_the_weight_decay_groups(saved_by, old, resumed_with, expected, tmp_path):
    from harness.resume import check_compatible

    errors = check_compatible(saved_meta(*saved_by, old=old), make(*resumed_with), tmp_path)
    if expected is None:
        assert errors == []
        return
    [error] = errors
    for text in [*expected, "param group", "checkpoint.resume=never"]:
        assert text in error, f"{text!r} not in:\n{error}"


def test_an_old_checkpoint_resumed_by_the_new_default_is_refused_before_any_rank_starts(tmp_path):
    meta = saved_meta(old=True)
    fake_checkpoint(tmp_path / "old" / "step_5", 5, **meta)
    with pytest.raises(ConfigError, match="optimizer.decay_1d=true to continue as saved"):
        validate_and_preflight(make(f"checkpoint.resume={tmp_path}/old/step_5"), tmp_path / "run")
    resume = f"checkpoint.resume={tmp_path}/old/step_5"
    validate_and_preflight(make(resume, "optimizer.decay_1d=true"), tmp_path / "run")


# -- GPT checkpoints saved before model.bias and model.tie_embeddings (check_compatible) --------

GPT_RESUMES = [  # (id, resumed with, texts of the refusal or None: it resumes as saved, biases and an untied head)
    (
        "new default",
        [],
        [
            "model.tie_embeddings: saved False (saved before the key existed), configured True",
            "Fix: model.tie_embeddings=false to continue as saved",
        ],
    ),
    ("untied", ["model.tie_embeddings=false"], None),
    (
        "no bias",
        ["model.tie_embeddings=false", "model.bias=false"],
        ["model.bias: saved True (saved before the key existed), configured False", "Fix: model.bias=true to continue"],
    ),
    (
        "another model",
        ["model=mlp"],
        ["model._target_: saved 'harness.models.GPT'", "Fix: set the model to the saved one"],
    ),
]


@pytest.mark.parametrize("resumed_with,expected", [r[1:] for r in GPT_RESUMES], ids=[r[0] for r in GPT_RESUMES])
def test_a_gpt_saved_before_bias_and_tie_embeddings_resumes_as_it_was_saved(resumed_with, expected, tmp_path):
    """Such a checkpoint's meta.json lacks both keys; its model had biases and its own head.weight."""
    from harness.resume import check_compatible

    meta = saved_meta("model.tie_embeddings=false")
    for model in (meta["model"], meta["config"]["model"]):
        del model["bias"], model["tie_embeddings"]
    errors = check_compatible(meta, make(*resumed_with), tmp_path)
    if expected is None:
        assert errors == []
        return
    [error] = errors
    for text in [*expected, "holds another model", "checkpoint.resume=never"]:
        assert text in error, f"{text!r} not in:\n{error}"
    assert "hidden: saved None (saved before" not in error  # a key the saved model never had is not filled
