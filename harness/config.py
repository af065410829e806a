"""The config schema: one dataclass per section or group option, registered with
Hydra's ConfigStore. Every default and every set of allowed values is stated
here and nowhere else; the YAML files under `conf/` hold only what an option
changes (tests/test_config.py fails when one repeats a default).

Each option's schema is stored under `schema/<group>` so schemas never show up
as selectable group options; a group's YAML pulls its schema in with
`/schema/<group>/<name>@_here_`, which gives typos and wrong types Hydra's own
startup error, and enums reject values outside their set the same way.
Components (model, data, optimizer, averager) are chosen by `_target_` and
built with `hydra.utils.instantiate`: a new one is a Python class and a YAML
file naming it.

Cross-field rules live in `harness.validate`, checks that touch the file
system in `harness.preflight`. This module imports neither torch nor
torch.distributed, so tools (`python -m harness.report`) stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, BooleanNode, DictConfig, OmegaConf, open_dict


class ConfigError(ValueError):
    """A config that cannot run; the message names key, value and fix."""


class OnResume(str, Enum):
    """What a resume does with a key whose value changed since the checkpoint (harness/resume.py)."""

    honoured = "honoured"  # the resumed run runs with the new value from its first step
    replanned = "replanned"  # the run's clock derives its plan again from the checkpoint's inputs, for the new value
    refused = "refused"  # refused before any rank starts: the checkpoint holds what the saved value made


@dataclass(frozen=True)
class Resume:
    """A key's resume rule: `on`, and what the resumed run does with a new value, in words (the resume's
    log line, docs/configuration.md's table); a rule may refuse some changes (its words say which)."""

    on: OnResume
    does: str


HONOURED = Resume(OnResume.honoured, "from the resumed run's first step")
SHAPE = Resume(OnResume.refused, "the checkpoint holds this model's parameters; another model cannot load them")
DATA = Resume(OnResume.refused, "the data position is a count of the saved data's samples, in its order")


class Choice(str, Enum):
    """One of a fixed set of strings; compares, prints and serialises as its string."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Device(Choice):
    auto = "auto"  # cuda when a GPU is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class StartMethod(Choice):
    auto = "auto"  # spawn for CUDA ranks (a forked child cannot use CUDA its parent touched), fork on CPU
    fork = "fork"
    spawn = "spawn"
    forkserver = "forkserver"


class NonFinite(Choice):
    error = "error"  # the step is not applied and training stops (docs/failures.md: how soon)
    skip = "skip"  # the step is not applied, training goes on


class Strategy(Choice):
    full_shard = "full_shard"
    shard_grad_op = "shard_grad_op"
    hybrid_shard = "hybrid_shard"
    hybrid_shard_zero2 = "hybrid_shard_zero2"
    no_shard = "no_shard"
    ddp = "ddp"


class DType(Choice):
    auto = "auto"  # param_dtype: bfloat16 on cuda, float32 on cpu; reduce_dtype: float32
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ActivationCheckpointing(Choice):
    none = "none"  # keep every block's activations for backward
    full = "full"  # recompute every block's activations in backward
    selective = "selective"  # recompute every other block's (torchtitan's layer-level selective AC)


class Float8Recipe(Choice):
    none = "none"  # the compute dtype's matmuls (bf16 on CUDA)
    tensorwise = "tensorwise"  # one scale per tensor; FSDP2 all-gathers the weights in float8
    rowwise = "rowwise"  # a scale per row: more accurate, the all-gather in the compute dtype


class CommDType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"  # sent in bf16, summed in fp32: half the bytes
    int8 = "int8"  # 8-bit values with an fp32 scale per 1024: about a quarter of the bytes
    float8_e4m3fn = "float8_e4m3fn"  # the same in float8 (torch builds that have the dtype)


class Balance(Choice):
    steps = "steps"  # every replica takes `averager.period` local steps between exchanges
    time = "time"  # each takes as many as it can in the fastest replica's `period` steps (harness/clock)


class PeriodSchedule(Choice):
    fixed = "fixed"  # `averager.period` throughout
    adacomm = "adacomm"  # from `averager.period`, shortened as the training loss falls (AdaComm)


class OuterDevice(Choice):
    device = "device"  # the rank's own device (the GPU on CUDA)
    cpu = "cpu"  # host memory: frees the device of the outer copy and state, costs a copy per sync


class CheckpointMode(Choice):
    none = "none"
    full = "full"
    sharded = "sharded"


class FaultToleranceMode(Choice):
    none = "none"  # one dead rank stops every rank (torchrun or the launcher restarts the whole job)
    torchft = "torchft"  # replica groups survive each other: torchft's lighthouse and Manager (docs/failures.md)


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# --- launch / process settings --------------------------------------------------


@dataclass
class LauncherConf:
    # ranks `python train.py` starts itself (ignored under torchrun); null = one
    # per visible GPU when the ranks use CUDA, else 2
    nproc: Optional[int] = None
    start_method: StartMethod = StartMethod.auto
    RESUME: ClassVar[Dict[str, Resume]] = {"nproc": HONOURED, "start_method": HONOURED}


@dataclass
class DistConf:
    timeout_s: int = 600  # process-group timeout: a hung collective fails after this
    threads_per_rank: Optional[int] = None  # CPU threads per rank; null = cores / ranks on the machine (all groups')
    RESUME: ClassVar[Dict[str, Resume]] = {"timeout_s": HONOURED, "threads_per_rank": HONOURED}


@dataclass
class ProfileConf:
    """`train.profile`: torch.profiler on a schedule, a trace per rank in <run dir>/profile/ (harness/profiling.py)."""

    enabled: bool = False
    wait: int = 5  # steps not traced first (start-up, compilation, the first quorum)
    warmup: int = 2  # steps traced and dropped: the profiler's own warm-up
    active: int = 3  # steps recorded into each trace
    repeat: int = 1  # windows of wait + warmup + active recorded; 0 = until the run ends
    keep: int = 5  # newest windows' traces and tables kept per rank (older ones deleted: repeat=0 fills no disk)
    memory_snapshot: bool = False  # CUDA: the allocator's history up to the first window's end (memory_viz)
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("enabled", "wait", "warmup", "active", "repeat", "keep", "memory_snapshot"), HONOURED
    )


@dataclass
class TrainConf:
    steps: int = 200
    batch_size: int = 8  # sequences per rank per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step: a step trains on grad_accum × batch_size per rank
    seq_len: int = 64
    seed: int = 0
    log_every: int = 10
    device: Device = Device.auto
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    nonfinite: NonFinite = NonFinite.error  # NaN/inf loss or gradients
    # torch.compile: a replica of one device the whole model and its loss, else each block and the output loss
    compile: bool = False
    # float8 matmuls in the blocks' linears through torchao (the float8 extra; CUDA compute capability 8.9+);
    # pays under train.compile (harness/float8.py, docs/gpu.md)
    float8: Float8Recipe = Float8Recipe.none
    # peak dense bf16 TFLOP/s of one device, for train/mfu; null = looked up
    # from the GPU's name (harness.throughput.PEAK_TFLOPS), none on CPU
    peak_tflops: Optional[float] = None
    eval_every: int = 0  # steps between eval/loss passes on the held-out data (and one at the end); 0 = none
    # batches of train.batch_size held-out windows per eval pass, spread over the held-out split and the
    # same every pass; "all": every window of the split (a full pass, for final numbers)
    eval_batches: Any = 4
    profile: ProfileConf = field(default_factory=ProfileConf)
    RESUME: ClassVar[Dict[str, Resume]] = {
        "steps": Resume(
            OnResume.replanned,
            "trains on to the new end (fewer: stops there), the period under way planned again and the last "
            "ended by an exchange; at or below the checkpoint's step refused: nothing is left to train",
        ),
        "batch_size": Resume(
            OnResume.honoured,
            "the data position (samples of the run so far) carries over: the next unread samples, none twice",
        ),
        "grad_accum": Resume(
            OnResume.honoured,
            "the data position (samples of the run so far) carries over: the next unread samples, none twice",
        ),
        "seq_len": Resume(
            OnResume.refused,
            "the data position counts windows of the saved length, and a GPT's position table has that many rows",
        ),
        "seed": Resume(OnResume.refused, "the data's order follows the seed: another would read samples twice"),
        "float8": Resume(
            OnResume.honoured,
            "the weights and optimizer state load as saved (plain tensors either way); the steps after train in "
            "the new precision",
        ),
        **dict.fromkeys(
            ("log_every", "device", "grad_clip", "nonfinite", "compile", "peak_tflops", "eval_every", "eval_batches"),
            HONOURED,
        ),
    }


# --- model ----------------------------------------------------------------------


DROPOUT = Resume(OnResume.honoured, "dropout has no parameter: from the resumed run's first step")


@dataclass
class ModelHarnessKeys:
    """Keys every model option has, which the harness applies (harness.models.HARNESS_KEYS)."""

    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    # a local Hugging Face checkpoint directory (safetensors) to start from, read through DCP;
    # models with Hugging Face's layout only (gpt, llama, hf): docs/models.md
    init_from: Optional[str] = None
    RESUME: ClassVar[Dict[str, Resume]] = {
        "activation_checkpointing": Resume(OnResume.honoured, "recomputing changes no parameter"),
        "init_from": Resume(OnResume.honoured, "not read: a resume's weights are the checkpoint's"),
    }


@dataclass
class GPTConf(ModelHarnessKeys):
    """nanoGPT's `model.py` GPT (harness/models/gpt.py); its position table holds train.seq_len positions
    (nanoGPT's block_size) unless n_positions says more. The defaults: nanoGPT's CPU "baby" shape with
    GPT-2's biases and tied head (preset with GPT-2 small's shape: conf/model/gpt2.yaml)."""

    _target_: str = "harness.models.GPT"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256
    bias: bool = True  # biases in every Linear and LayerNorm, as GPT-2 (nanoGPT's bias=False: none)
    tie_embeddings: bool = True  # the output head is the token embedding table, as GPT-2 and nanoGPT
    # the MLP's GELU, as config.json's activation_function: gelu, exact (nanoGPT's); gelu_new, the tanh
    # approximation GPT-2's checkpoints compute
    activation: str = "gelu"
    # the position table's rows (config.json's n_positions); null = train.seq_len. More rows than
    # train.seq_len (a GPT-2 checkpoint's 1024) are kept and not used; fewer are refused
    n_positions: Optional[int] = None
    dropout: float = 0.0  # embedding, attention and residual dropout, nanoGPT's (each rank's seeded torch RNG)
    RESUME: ClassVar[Dict[str, Resume]] = {
        **dict.fromkeys(
            ("_target_", "n_layer", "n_head", "d_model", "vocab_size", "bias", "tie_embeddings", "n_positions"), SHAPE
        ),
        "activation": Resume(OnResume.refused, "the saved weights were trained through their GELU, not another"),
        "dropout": DROPOUT,
    }


@dataclass
class MLPConf(ModelHarnessKeys):
    _target_: str = "harness.models.TokenMLP"
    n_layer: int = 2
    d_model: int = 64
    hidden: int = 256
    vocab_size: int = 256
    dropout: float = 0.0  # residual dropout (drawn from each rank's seeded torch RNG)
    RESUME: ClassVar[Dict[str, Resume]] = {
        **dict.fromkeys(("_target_", "n_layer", "d_model", "hidden", "vocab_size"), SHAPE),
        "dropout": DROPOUT,
    }


@dataclass
class LlamaConf(ModelHarnessKeys):
    """Llama 3 (harness/models/llama.py); the defaults are a debug shape that trains in seconds on CPU
    (presets with published shapes: conf/model/llama3_1b.yaml, llama3_8b.yaml)."""

    _target_: str = "harness.models.Llama"
    n_layer: int = 2
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2  # key/value heads of grouped-query attention; null = n_heads
    multiple_of: int = 256  # the SwiGLU width is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None  # scales the SwiGLU width (2/3 of 4 * d_model) before rounding
    intermediate_size: Optional[int] = None  # the SwiGLU width; null = the rule of the two keys above
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1's RoPE frequency scaling as config.json spells it: {rope_type: llama3, factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings}; null = none
    rope_scaling: Optional[Dict[str, Any]] = None
    # the context length config.json records (export writes it; positions are not limited by it); null = train.seq_len
    max_position_embeddings: Optional[int] = None
    tie_embeddings: bool = False  # the output projection is the embedding table
    vocab_size: int = 256
    dropout: float = 0.0  # attention and residual dropout (drawn from each rank's seeded torch RNG)
    RESUME: ClassVar[Dict[str, Resume]] = {
        **dict.fromkeys(
            (
                "_target_",
                "n_layer",
                "d_model",
                "n_heads",
                "n_kv_heads",
                "multiple_of",
                "ffn_dim_multiplier",
                "intermediate_size",
                "norm_eps",
                "rope_theta",
                "rope_scaling",
                "tie_embeddings",
                "vocab_size",
            ),
            SHAPE,
        ),
        "max_position_embeddings": Resume(OnResume.honoured, "recorded for an export; positions are not limited by it"),
        "dropout": DROPOUT,
    }


@dataclass
class HFConf(ModelHarnessKeys):
    """Any transformers causal LM built from its config (harness/models/hf.py; needs the hf extra).
    The default is a Llama of the debug shape of model=llama, built by transformers."""

    _target_: str = "harness.models.HFCausalLM"
    config: Optional[str] = None  # a local directory with a config.json; null = model_type's defaults
    model_type: Optional[str] = "llama"  # a transformers model type (AutoConfig.for_model), when config is null
    # single keys of the transformers config replaced, e.g. model.config_overrides.num_hidden_layers=4
    config_overrides: Dict[str, Any] = field(
        default_factory=lambda: {
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    vocab_size: int = 256
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("_target_", "config", "model_type", "config_overrides", "vocab_size"), SHAPE
    )


# --- data -----------------------------------------------------------------------


@dataclass
class SyntheticDataConf:
    _target_: str = "harness.data.SyntheticTokens"
    noise: float = 0.1  # probability that a token breaks the learnable pattern
    RESUME: ClassVar[Dict[str, Resume]] = {"_target_": DATA, "noise": DATA}


@dataclass
class TextDataConf:
    _target_: str = "harness.data.TextTokens"
    root: Optional[str] = None  # null = the Python standard library's own sources (no download)
    glob: str = "**/*.py"
    max_bytes: int = 64 * 2**20  # stop reading files past this many bytes
    eval_fraction: float = 0.01  # the corpus's last bytes held out for eval/loss, never trained on
    cache_dir: str = "~/.cache/harness"
    RESUME: ClassVar[Dict[str, Resume]] = {
        **dict.fromkeys(("_target_", "root", "glob", "max_bytes", "eval_fraction"), DATA),
        "cache_dir": Resume(OnResume.honoured, "where the tokenized corpus is cached: the same tokens"),
    }


class TokenFormat(Choice):
    harness = "harness"  # python -m harness.prepare's shards and index.json
    nanogpt = "nanogpt"  # nanoGPT's train.bin / val.bin (uint16, no index)


@dataclass
class TokensDataConf:
    """Pretokenized shards (harness/data/tokens.py, docs/data.md): one dataset, or a weighted mixture."""

    _target_: str = "harness.data.TokenShards"
    path: Optional[str] = None  # a `python -m harness.prepare` output directory
    sources: Optional[List[Any]] = None  # instead of path, a mixture: [{path: <dir>, weight: 0.7}, ...]
    format: TokenFormat = TokenFormat.harness
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(("_target_", "path", "sources", "format"), DATA)


# --- optimizer ------------------------------------------------------------------

# a setting of the optimizer's param groups: the run's config wins over the checkpoint's groups
OPTIMIZER_SETTING = Resume(
    OnResume.honoured,
    "the run's value replaces the checkpoint's in the optimizer's param groups (a scheduled lr: the schedule's at "
    "the saved position)",
)
DECAY = Resume(
    OnResume.honoured,
    "the run's decay replaces the checkpoint's; refused where it would change the weight-decay groups (their "
    "saved state loads into the same groups only)",
)


def optimizer_rules(*settings: str) -> dict[str, Resume]:
    """An optimizer option's rules: its class refused, its `settings` and weight decay honoured."""
    return {
        "_target_": Resume(OnResume.refused, "the checkpoint holds the saved optimizer's state"),
        "_partial_": HONOURED,
        **dict.fromkeys(settings, OPTIMIZER_SETTING),
        **dict.fromkeys(("weight_decay", "decay_1d"), DECAY),
        "in_backward": Resume(
            OnResume.honoured, "the per-parameter optimizers save and load the same parameter-keyed state"
        ),
    }


@dataclass
class SGDConf:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    fused: Optional[bool] = None  # null = fused kernels on CUDA, the class's default elsewhere
    in_backward: bool = False  # step each parameter as soon as its gradient is ready (FSDP2 strategies)
    decay_1d: bool = False  # weight decay on 1-D parameters too (biases, norm weights); false: matrices only
    RESUME: ClassVar[Dict[str, Resume]] = optimizer_rules("lr", "momentum", "nesterov", "fused")


@dataclass
class AdamConf:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = 3e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: Optional[bool] = None  # null = fused kernels on CUDA, the class's default elsewhere
    in_backward: bool = False  # step each parameter as soon as its gradient is ready (FSDP2 strategies)
    decay_1d: bool = False  # weight decay on 1-D parameters too (biases, norm weights); false: matrices only
    RESUME: ClassVar[Dict[str, Resume]] = optimizer_rules("lr", "betas", "eps", "fused")


@dataclass
class AdamWConf(AdamConf):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01


def decays_matrices_only(optimizer) -> bool:
    """Whether the optimizer config `optimizer` (a schema's, a plain dict, one
    saved in a checkpoint's meta.json) gives its weight decay to parameters of 2
    or more dimensions only, in two groups (`harness.optim.param_groups`).
    Without `decay_1d` (a YAML that pulls in no schema, a checkpoint saved
    before the key existed) it is one group, as every optimizer was then."""
    return not optimizer.get("decay_1d", True) and bool(optimizer.get("weight_decay"))


# --- learning-rate schedule (harness.lr_schedules) -------------------------------

SCHEDULE = Resume(OnResume.honoured, "the new schedule from the saved position (its step)")


@dataclass
class ConstantLRConf:
    _target_: str = "harness.lr_schedules.Constant"
    _partial_: bool = True
    RESUME: ClassVar[Dict[str, Resume]] = {"_target_": SCHEDULE, "_partial_": SCHEDULE}


@dataclass
class WarmupCosineLRConf:
    _target_: str = "harness.lr_schedules.WarmupCosine"
    _partial_: bool = True
    warmup_steps: int = 20  # linear warmup from optimizer.lr / warmup_steps up to optimizer.lr
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of optimizer.lr at the last step
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("_target_", "_partial_", "warmup_steps", "min_lr_ratio"), SCHEDULE
    )


@dataclass
class WSDLRConf:
    _target_: str = "harness.lr_schedules.WarmupStableDecay"
    _partial_: bool = True
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # the last 20 % of train.steps decay linearly ...
    min_lr_ratio: float = 0.0  # ... to this fraction of optimizer.lr
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("_target_", "_partial_", "warmup_steps", "decay_fraction", "min_lr_ratio"), SCHEDULE
    )


@dataclass
class StepLRConf:
    """Multi-step decay (the post-local SGD paper's schedule): optimizer.lr × gamma after each milestone."""

    _target_: str = "torch.optim.lr_scheduler.MultiStepLR"
    _partial_: bool = True
    milestones: List[int] = field(default_factory=lambda: [100, 150])  # steps after which the lr decays
    gamma: float = 0.1
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(("_target_", "_partial_", "milestones", "gamma"), SCHEDULE)


# --- averager -------------------------------------------------------------------

AVERAGER = Resume(
    OnResume.replanned,
    "the new averager's plan from the checkpoint's step (none: synchronous, every replica from the mean of the "
    "saved copies; DiLoCo without outer state in the checkpoint: its outer copy from that mean)",
)
PLAN = Resume(
    OnResume.replanned,
    "the period under way planned again from its start (a replica past its new share takes one more step, "
    "then the exchange); the periods after follow the new value",
)
WARMUP = Resume(
    OnResume.replanned,
    "synchronous up to the new value (lower: local from the checkpoint's step, DiLoCo's outer copy set there); "
    "refused above the checkpoint's step once its replicas trained apart (a warmup averages gradients, not models)",
)
COMM = Resume(OnResume.honoured, "from the next exchange")


@dataclass
class PaceConf:
    """How many local steps each replica takes between exchanges (the run's clock plans them: `harness/clock`)."""

    balance: Balance = Balance.steps  # time: local steps balanced by each replica's measured speed
    period_schedule: PeriodSchedule = PeriodSchedule.fixed  # adacomm: the period follows the training loss
    min_period: int = 1  # adacomm and period=auto never take a period below this
    # period=auto: the longest period it may take (a replica's drift grows with it; DiLoCo's paper goes to 500)
    max_period: int = 64
    # period=auto: the share of wall time exchanges may hold training up (docs/configuration.md#choosing-a-period)
    comm_budget: float = 0.1
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("balance", "period_schedule", "min_period", "max_period", "comm_budget"), PLAN
    )


@dataclass
class NoAveragerConf:
    _target_: Optional[str] = None  # synchronous: gradients are averaged across replicas every step
    RESUME: ClassVar[Dict[str, Resume]] = {"_target_": AVERAGER}
    # what refuses another averager's key given here (`averager=none averager.balance=time`)
    OTHER_KEYS: ClassVar[str] = (
        "averager=none trains synchronously (gradients averaged every step): no local steps to average, "
        "plan or balance, so it takes none of the averagers' keys. Fix: averager=periodic or averager=diloco "
        "to use it, or leave {key} out."
    )


@dataclass
class PeriodicAveragerConf(PaceConf):
    _target_: str = "harness.averaging.ReplicaAverager"
    # average parameters across replicas every `period` steps (auto: chosen at each exchange from what
    # exchanges cost, within averager.comm_budget) ...
    period: Any = 4
    INTEGER_OR: ClassVar[Dict[str, str]] = {"period": "auto"}  # a key typed Any: an integer, or this word
    warmup_steps: int = 10  # ... after this many fully synchronous steps
    comm_dtype: CommDType = CommDType.float32  # dtype the averaged tensors cross replicas in
    RESUME: ClassVar[Dict[str, Resume]] = {
        "_target_": AVERAGER,
        "period": PLAN,
        "warmup_steps": WARMUP,
        "comm_dtype": COMM,
    }


@dataclass
class HierarchicalAveragerConf(PaceConf):
    _target_: str = "harness.averaging.HierarchicalReplicaAverager"
    # [period, replicas per group] pairs: PyTorch's HierarchicalModelAverager
    # `period_group_size_dict` as a list, because Hydra merges a dict override
    # into the old dict instead of replacing it. At a step past warmup the
    # largest period dividing the step wins: [[2, 2], [8, 4]] averages pairs of
    # replicas every 2 steps and all 4 replicas every 8.
    period_group_size: List[List[int]] = field(default_factory=lambda: [[2, 2], [8, 4]])
    warmup_steps: int = 10
    comm_dtype: CommDType = CommDType.float32
    # the keys of the other averagers it has no use for, and why
    NOT_TAKEN: ClassVar[Dict[str, str]] = {
        "period": (
            "averager=hierarchical averages at the periods of averager.period_group_size, one per level, so it has "
            "no averager.period, and period=auto is not built for it (each level's exchanges cross links of their "
            "own, which one budget cannot speak for). Fix: averager=periodic averager.period=auto (or diloco), or "
            "periods in averager.period_group_size."
        )
    }
    RESUME: ClassVar[Dict[str, Resume]] = {
        "_target_": AVERAGER,
        "period_group_size": PLAN,
        "warmup_steps": WARMUP,
        "comm_dtype": COMM,
    }


@dataclass
class DiLoCoAveragerConf(PaceConf):
    """DiLoCo (arXiv 2311.08105): every `period` steps the replicas' mean change
    is the gradient of one outer-optimizer step; Streaming DiLoCo's fragments
    (arXiv 2501.18512) spread that sync over the period."""

    _target_: str = "harness.averaging.DiLoCoAverager"
    period: Any = 16  # local steps between syncs of the same fragment; auto: as ReplicaAverager's
    INTEGER_OR: ClassVar[Dict[str, str]] = {"period": "auto"}
    warmup_steps: int = 10
    comm_dtype: CommDType = CommDType.float32  # dtype the pseudo-gradients cross replicas in
    fragments: int = 1  # parts of the model synced at their own offsets inside the period
    outer_device: OuterDevice = OuterDevice.device  # where the outer parameters and their optimizer state live
    # Streaming DiLoCo's overlap (torchft's fragment_sync_delay): a fragment's all-reduce starts at its
    # sync step and its outer step is applied this many local steps later, the collective running meanwhile
    sync_delay: int = 0
    # weight of the locally trained parameters against the outer-updated ones when a sync is applied
    # (torchft's fragment_update_alpha): 0 takes the outer parameters, as DiLoCo does
    mix: float = 0.0
    outer_optimizer: Any = None  # a torch.optim class: the averager/outer_optimizer group
    RESUME: ClassVar[Dict[str, Resume]] = {
        "_target_": AVERAGER,
        "period": PLAN,
        "warmup_steps": WARMUP,
        "comm_dtype": COMM,
        "fragments": Resume(
            OnResume.replanned,
            "the new fragments from the next exchange; refused with a sync in flight in the checkpoint (its mean "
            "is the old fragment's)",
        ),
        "outer_device": Resume(OnResume.honoured, "the outer copy and state load where the new value says"),
        "sync_delay": Resume(
            OnResume.honoured,
            "from the next sync; a sync in flight in the checkpoint is applied before the first step once the "
            "new delay is over (0 included)",
        ),
        "mix": Resume(OnResume.honoured, "from the next sync applied"),
        "outer_optimizer._target_": Resume(
            OnResume.honoured,
            "the new outer optimizer from the next sync; refused where the checkpoint holds the saved one's state",
        ),
    }


# --- sharding -------------------------------------------------------------------

LAYOUT = Resume(OnResume.honoured, "the checkpoint reshards into the new layout, exactly")


@dataclass
class ShardingConf:
    strategy: Strategy = MISSING  # each sharding/<option>.yaml sets it
    # Replica count of the (replicate, shard) mesh. Only hybrid strategies take a
    # value (null: one replica per node, 2 on a single node); for the others null
    # means "what the strategy implies" (1 for full/grad-op sharding, world size
    # for no_shard and ddp).
    replicate: Optional[int] = None
    # compute dtype: FSDP2's mixed-precision params; autocast for ddp and a replica of one rank (float16 refused:
    # no gradient scaler)
    param_dtype: DType = DType.auto
    # gradient reductions: FSDP2's reduce-scatter; a replica of one rank's gradient buckets where they cross replicas
    reduce_dtype: DType = DType.float32
    RESUME: ClassVar[Dict[str, Resume]] = {
        **dict.fromkeys(("strategy", "param_dtype", "reduce_dtype"), LAYOUT),
        "replicate": Resume(
            OnResume.replanned,
            "another replica count: the global step stays, each replica's figures start afresh, a period the "
            "replicas were apart in starts over at the checkpoint's step, every replica from the mean of the "
            "saved copies",
        ),
    }


# --- fault tolerance ------------------------------------------------------------


@dataclass
class FaultToleranceConf:
    """Replica groups that survive each other (harness/fault_tolerance/; docs/failures.md; needs the ft extra)."""

    mode: FaultToleranceMode = MISSING  # each fault_tolerance/<option>.yaml sets it
    min_replicas: int = 1  # replica groups a sync needs; with fewer the survivors wait at the quorum
    lighthouse: Optional[str] = None  # torchft lighthouse URL (http://host:port); null: the launcher starts one
    replica_id: Optional[int] = None  # this replica group; null: REPLICA_GROUP_ID (torchft's launcher convention)
    quorum_timeout_s: float = 300.0  # a quorum (at most once a step) fails after this; covers a peer's restart
    timeout_s: float = 60.0  # a cross-replica collective or a heal's transfer fails after this
    # the lighthouse started here counts a silent group as gone after this (its Manager beats every 0.1 s
    # from its own threads): a group's death costs its peers up to this at their next quorum (torchft's
    # lighthouse: 5 s)
    heartbeat_timeout_s: float = 0.5
    # ... and, once more than half the beating groups have asked, waits this long for the rest (a quorum
    # whose members are the last one's forms at once): a live group late at a sync is waited for, not
    # left out and healed (torchft's lighthouse: 60 s). null: 0.2 s with 2 replica groups, where a late
    # live group is never left out (one group is not more than half of two), else 10 s
    join_timeout_s: Optional[float] = None
    max_restarts: int = 3  # restarts of each replica group the launcher allows (torchrun: its --max-restarts)
    # exchanges across replica groups in a row that may fail to commit (each within timeout_s) before the run
    # stops: a run whose exchanges never commit trains nothing
    max_failed_exchanges: int = 5
    RESUME: ClassVar[Dict[str, Resume]] = {
        "mode": Resume(
            OnResume.replanned,
            "replica groups from one world's checkpoint, or one world from the groups' (at their newest common "
            "step): every replica from the mean of the copies, said in the log",
        ),
        **dict.fromkeys(
            (
                "min_replicas",
                "lighthouse",
                "replica_id",
                "quorum_timeout_s",
                "timeout_s",
                "heartbeat_timeout_s",
                "join_timeout_s",
                "max_restarts",
                "max_failed_exchanges",
            ),
            HONOURED,
        ),
    }


# --- checkpoint / wandb ---------------------------------------------------------


@dataclass
class CheckpointConf:
    mode: CheckpointMode = MISSING  # each checkpoint/<option>.yaml sets it
    interval: int = 100  # steps between checkpoints (and one at the last step)
    keep: int = 2  # complete checkpoints kept
    resume: str = "auto"  # auto (latest complete one in dir, if any) | never | <path>
    dir: Optional[str] = None  # null = <run dir>/checkpoints
    # + `async: bool = False` (sharded only: dcp.async_save), added by
    # `checkpoint_schema` because `async` is a Python keyword.
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("mode", "interval", "keep", "resume", "dir", "async"), HONOURED
    )


def checkpoint_schema() -> DictConfig:
    """CheckpointConf plus a typed `async` key, which no dataclass can declare.

    A BooleanNode gets the same Hydra errors as a dataclass field
    (`checkpoint.async=maybe` -> "Value 'maybe' is not a valid bool").
    """
    node = OmegaConf.structured(CheckpointConf)
    with open_dict(node):
        node["async"] = BooleanNode(False)
    return node


def hf_schema() -> DictConfig:
    """HFConf whose `config_overrides` takes any key without '+' (transformers' keys are many, and
    not ours to list): `model.config_overrides.tie_word_embeddings=true` sets it; HFCausalLM refuses
    a key the transformers config does not have."""
    node = OmegaConf.structured(HFConf)
    OmegaConf.set_struct(node.config_overrides, False)
    return node


EXTRA_KEYS = {CheckpointConf: {"async"}}  # schema keys no dataclass field can carry (see checkpoint_schema)


@dataclass
class WandbConf:
    mode: WandbMode = WandbMode.offline  # the WANDB_MODE environment variable wins when set
    project: str = "harness"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    init_timeout_s: float = 90.0  # W&B's own default; online without network falls back to offline after this
    RESUME: ClassVar[Dict[str, Resume]] = dict.fromkeys(
        ("mode", "project", "entity", "group", "name", "tags", "init_timeout_s"),
        Resume(OnResume.honoured, "a resumed run is a W&B run of its own, from the checkpoint's step"),
    )


@dataclass
class MetricsConf:
    # also write every metric as TensorBoard event files in <run dir>/tensorboard/, for clusters whose compute
    # nodes cannot reach W&B (needs the `tensorboard` extra)
    tensorboard: bool = False
    RESUME: ClassVar[Dict[str, Resume]] = {"tensorboard": HONOURED}


@dataclass
class Config:
    model: Any = None
    data: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    averager: Any = None
    sharding: Any = None
    checkpoint: Any = None
    fault_tolerance: Any = None
    wandb: Any = None
    launcher: LauncherConf = field(default_factory=LauncherConf)
    dist: DistConf = field(default_factory=DistConf)
    train: TrainConf = field(default_factory=TrainConf)
    metrics: MetricsConf = field(default_factory=MetricsConf)


SCHEMAS = {
    "model": {"gpt": GPTConf, "mlp": MLPConf, "llama": LlamaConf, "hf": HFConf},
    "data": {"synthetic": SyntheticDataConf, "text": TextDataConf, "tokens": TokensDataConf},
    "optimizer": {"sgd": SGDConf, "adam": AdamConf, "adamw": AdamWConf},
    "lr_scheduler": {
        "constant": ConstantLRConf,
        "warmup_cosine": WarmupCosineLRConf,
        "wsd": WSDLRConf,
        "step": StepLRConf,
    },
    "averager": {
        "none": NoAveragerConf,
        "periodic": PeriodicAveragerConf,
        "hierarchical": HierarchicalAveragerConf,
        "diloco": DiLoCoAveragerConf,
    },
    "sharding": {"sharding": ShardingConf},
    "checkpoint": {"checkpoint": CheckpointConf},
    "fault_tolerance": {"fault_tolerance": FaultToleranceConf},
    "wandb": {"wandb": WandbConf},
}


@dataclass
class PrepareConf:
    """`python -m harness.prepare` (conf/prepare.yaml, docs/data.md): local raw text to token shards."""

    # files or globs (one, or a list): .jsonl/.json and .parquet records, any other file plain text
    input: Any = MISSING
    out: str = MISSING  # the dataset directory (data.path of data=tokens)
    text_field: str = "text"  # the field holding the text in .jsonl/.json/.parquet records
    # a tokenizer.json (Hugging Face tokenizers) or a Hugging Face model directory (its tokenizer.json and
    # eos_token); null: train a byte-level BPE
    tokenizer: Optional[str] = None
    vocab_size: int = 8192  # of the BPE trained when tokenizer is null
    # separates documents; the trained BPE has it as a special token; a model directory's eos_token replaces it
    eot_token: str = "<|endoftext|>"
    eval_fraction: float = 0.01  # the share of documents held out (drawn by seed), never trained on
    docs_per_shard: int = 4096
    skip_undecodable: bool = False  # skip input files that are not UTF-8 text (binary files) instead of refusing
    num_proc: Optional[int] = None  # tokenizer threads; null = every core
    seed: int = 0


SPECIAL_SCHEMAS = {CheckpointConf: checkpoint_schema, HFConf: hf_schema}  # schemas no dataclass alone declares


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    cs.store(name="schema_prepare", node=PrepareConf)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            node = SPECIAL_SCHEMAS[schema]() if schema in SPECIAL_SCHEMAS else schema
            cs.store(group=f"schema/{group}", name=name, node=node)


def plain(cfg: DictConfig) -> dict:
    """`cfg` as plain Python values (enums as their strings): for W&B, JSON and other processes."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
