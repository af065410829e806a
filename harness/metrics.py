"""Every metric the harness logs, declared once: its name, unit, when it is
logged and what it means.

A `Metric` is its own name (a `str`), so rows are plain dicts keyed by these
constants: `row[TRAIN_LOSS] = loss`. The sinks refuse a name that is not
declared here (`check_declared`), W&B's `define_metric` calls, the report's
columns and the table in docs/outputs.md (`python -m harness.metrics`; a test
compares) all read `METRICS`. Pure: no torch, so `harness.report` stays light.
"""

from __future__ import annotations


class Metric(str):
    """A metric name with its declaration."""

    unit: str
    when: str
    meaning: str
    summary: str | None  # W&B's run summary for it ("min", "max", "last"); None: W&B's default (last)

    def __new__(cls, name: str, unit: str, when: str, meaning: str, summary: str | None = None) -> Metric:
        metric = super().__new__(cls, name)
        metric.unit, metric.when, metric.meaning, metric.summary = unit, when, meaning, summary
        return metric

    def named(self, name: str) -> str:
        """One member of a family metric (a name ending in `*`): the `*` replaced by `name`."""
        return self.replace("*", name)

    @property
    def section(self) -> str:
        """The dashboard section: the part before the slash."""
        return self.split("/", 1)[0]


LOG = "log steps (1, every `train.log_every`, the last)"
ROW = "every logged row"
AVERAGING = "log steps and averaging steps, with an averager"
SYNC = "averaging (DiLoCo: sync) steps"
REPLICAS = "every logged row, with several replicas"
SAVE = "each checkpoint save"
ASYNC_DONE = "the step an async save became durable"
RESUME = "the step a run resumed from"

TRAIN_STEP = Metric("train/step", "step", ROW, "the optimizer step: the x-axis of every other metric")
TRAIN_LOSS = Metric("train/loss", "nats", LOG, "next-token cross-entropy, mean over ranks", "min")
TRAIN_LR = Metric("train/lr", "", LOG, "the local optimizer's learning rate")
TRAIN_GRAD_NORM = Metric(
    "train/grad_norm", "", LOG, "global L2 norm of the gradients before clipping (not with `optimizer.in_backward`)"
)
TRAIN_STEP_TIME = Metric(
    "train/step_time_s",
    "s",
    LOG,
    "wall time per step, mean since the previous log step, its eval passes and saves left out (`eval/time_s`, "
    "`checkpoint/save_s`)",
)
TRAIN_TOKENS_PER_S = Metric(
    "train/tokens_per_s", "tokens/s", LOG, "tokens trained per second, all ranks together (over `train/step_time_s`)"
)
TRAIN_MFU = Metric(
    "train/mfu",
    "",
    LOG + ", when the device's peak is known",
    "model FLOPs utilisation per device: tokens/s per device × FLOPs/token over the peak "
    "(`train.peak_tflops` or `harness.throughput.PEAK_TFLOPS`)",
)
TRAIN_SKIPPED_NONFINITE = Metric(
    "train/skipped_nonfinite",
    "steps",
    "under `train.nonfinite=skip`, the first row after a skipped step (a log, eval, save or averaging step; with a "
    "non-fused optimizer, the skipped step itself)",
    "steps whose update was skipped for a NaN/inf loss or gradient since the previous such row, on rank 0",
)
DATA_SOURCE_TOKENS = Metric(
    "data/tokens/*",
    "tokens",
    LOG + ", with `data.sources`",
    "tokens read from each source of a mixture so far, all ranks (`*`: the source's directory name)",
)
EVAL_LOSS = Metric(
    "eval/loss",
    "nats",
    "every `train.eval_every` steps and the last",
    "held-out cross-entropy, mean over ranks (between averagings: over the replicas, each scored on the same batches): "
    "an estimate of the whole held-out split's, or that loss itself with `train.eval_batches=all` "
    "([below](#what-evalloss-estimates))",
    "min",
)
EVAL_SOURCE_LOSS = Metric(
    "eval/loss/*",
    "nats",
    "every `train.eval_every` steps and the last, with `data.sources`",
    "held-out cross-entropy on each source of a mixture, mean over ranks (`*`: the source's directory name); "
    "`eval/loss` is their mean weighted by `data.sources`' weights",
    "min",
)
EVAL_TIME = Metric(
    "eval/time_s", "s", "every `train.eval_every` steps and the last", "wall time of the eval pass (`eval/loss`)"
)
MEMORY_MAX_RSS = Metric("memory/max_rss_gb", "GiB", LOG + " (CPU)", "peak resident memory of rank 0's process")
MEMORY_CUDA_MAX = Metric(
    "memory/cuda_max_allocated_gb", "GiB", LOG + " (CUDA)", "peak memory allocated by torch on rank 0's GPU"
)
COMM_GRAD_SYNC_BYTES = Metric(
    "comm/grad_sync_bytes",
    "bytes",
    REPLICAS,
    "gradient bytes this rank all-reduced across replicas since the previous logged row (rows add up to the total)",
)
COMM_AVERAGING_BYTES = Metric(
    "comm/averaging_bytes",
    "bytes",
    REPLICAS,
    "parameter (DiLoCo: pseudo-gradient) bytes this rank sent into cross-replica averaging since the previous "
    "logged row, in `comm_dtype`",
)
COMM_TOTAL_BYTES = Metric(
    "comm/cross_replica_bytes_total", "bytes", REPLICAS, "running total of this rank's cross-replica bytes"
)
AVERAGER_AVERAGED = Metric("averager/averaged", "", AVERAGING, "1 on steps that averaged (or synced), else 0")
AVERAGER_STEP = Metric(
    "averager/step", "step", AVERAGING, "rank 0's replica's local steps so far, warmup included (the run's clock)"
)
AVERAGER_DRIFT = Metric(
    "averager/drift",
    "",
    SYNC,
    "how far the replicas had drifted apart just before averaging: sqrt(Σ‖x_r − x̄‖² / Σ‖x̄‖²) over the averaging "
    "group's local shards (hierarchical: rank 0's group; not for a DiLoCo sync applied after a resume inside its "
    "delay window)",
)
AVERAGER_TIME = Metric(
    "averager/time_s",
    "s",
    SYNC,
    "wall time of the averaging collectives (DiLoCo with `sync_delay`: the time the sync held training up)",
)
AVERAGER_PSEUDO_GRAD_NORM = Metric(
    "averager/pseudo_grad_norm", "", SYNC + " (DiLoCo)", "‖mean Δ‖ over the synced fragment, all ranks' shards"
)
AVERAGER_OUTER_LR = Metric("averager/outer_lr", "", SYNC + " (DiLoCo)", "the outer optimizer's learning rate")
AVERAGER_FRAGMENT = Metric(
    "averager/fragment", "", SYNC + " (DiLoCo)", "the fragment synced (0 without `averager.fragments`)"
)
EXCHANGE = "exchanges, with `averager.balance=time`, `averager.period_schedule=adacomm` or `averager.period=auto`"
AUTO_EXCHANGE = "exchanges, with `averager.period=auto`"
AVERAGER_EXCHANGE_TIME = Metric(
    "averager/exchange_s",
    "s",
    AUTO_EXCHANGE,
    "the time an exchange holds training up, smoothed over exchanges (what a DiLoCo delay hides left out; under "
    "fault tolerance its quorum in): what auto chooses the next period from",
)
AVERAGER_EXCHANGE_SHARE = Metric(
    "averager/exchange_share",
    "",
    AUTO_EXCHANGE,
    "the share of the wall time exchanges took over the period this exchange ends, from the smoothed exchange and "
    "step times: auto keeps it within `averager.comm_budget`",
)
AVERAGER_PERIOD = Metric(
    "averager/period",
    "steps",
    EXCHANGE,
    "the period this exchange ends, as taken: its longest replica's local steps (times the fragments; the first "
    "and a cut last period's too)",
)
REPLICA_LOCAL_STEPS = Metric(
    "replica/local_steps/*", "steps", EXCHANGE, "local steps replica `*` took since the previous exchange"
)
REPLICA_STEP_TIME = Metric(
    "replica/step_time_s/*",
    "s",
    EXCHANGE,
    "replica `*`'s wall time per local step since the previous exchange (the exchange itself excluded)",
)
REPLICA_WAIT = Metric(
    "replica/wait_s/*",
    "s",
    EXCHANGE,
    "time replica `*` waited at this exchange for the last replica to arrive: the straggler cost "
    "(from the hosts' clocks)",
)
REPLICA_SAMPLES = Metric("replica/samples/*", "samples", EXCHANGE, "samples replica `*` trained so far")
CHECKPOINT_MODE = Metric(
    "checkpoint/mode", "", SAVE, "`checkpoint.mode` (`full` or `sharded`), as meta.json records it"
)
CHECKPOINT_STATE_DICT = Metric(
    "checkpoint/state_dict_s", "s", SAVE, "gathering the state dicts and staging the payload"
)
CHECKPOINT_SAVE = Metric("checkpoint/save_s", "s", SAVE, "time training was blocked by the save")
CHECKPOINT_WRITE = Metric(
    "checkpoint/write_s",
    "s",
    f"{SAVE} (sync); {ASYNC_DONE} (async)",
    "sync: writing after the state dicts until committed (`save_s − state_dict_s`); async: from the save's start "
    "until committed",
)
CHECKPOINT_STAGING_WAIT = Metric(
    "checkpoint/staging_wait_s", "s", ASYNC_DONE, "time the loop waited for an async save's host copy"
)
CHECKPOINT_BYTES = Metric("checkpoint/bytes", "bytes", "each commit", "size of the committed checkpoint on disk")
CHECKPOINT_LOAD = Metric("checkpoint/load_s", "s", RESUME, "loading the checkpoint, everything included")
CHECKPOINT_SET_STATE_DICT = Metric(
    "checkpoint/set_state_dict_s", "s", RESUME, "setting the loaded state dicts into model and optimizer"
)
FT = "every logged row, with fault_tolerance=torchft"
FT_QUORUM_STEP = "steps that opened a quorum, with fault_tolerance=torchft"
FT_REPLICAS = Metric("ft/replicas", "", FT, "replica groups in the quorum of this group's last quorum")
FT_HEALS = Metric("ft/heals", "", FT, "times this replica group was healed from a live peer, cumulative")
FT_SKIPPED_STEPS = Metric(
    "ft/skipped_steps",
    "",
    FT,
    "steps whose gradient exchange across replica groups did not commit, so the step was skipped (synchronous "
    "steps: averager=none, or an averager's warmup), cumulative since this group's (re)start",
)
FT_HEAL_TIME = Metric(
    "ft/heal_s",
    "s",
    "the step a replica group was healed",
    "from asking for the quorum to holding a live peer's state: the wait for the peers' quorum, the transfer, the load",
)
FT_HEAL_SENT_BYTES = Metric(
    "ft/heal_sent_bytes",
    "bytes",
    "the step a replica group healed a peer (on the sender)",
    "the heal state this rank staged in host memory to send: a heal's extra memory (none on the device)",
)
FT_QUORUM_TIME = Metric(
    "ft/quorum_s", "s", FT_QUORUM_STEP, "waiting for the quorum at the step's start (a heal's time included)"
)
RUN_RESUMED_FROM = Metric("run/resumed_from_step", "step", RESUME, "the checkpoint's step")
RUN_RESTARTS = Metric("run/restarts", "", RESUME, "torchrun's restart count of this run")

METRICS: dict[str, Metric] = {m: m for m in list(globals().values()) if isinstance(m, Metric)}  # in declaration order


def check_declared(row: dict) -> None:
    """Refuse a row with a name no `Metric` declares: every name is declared here
    (a family, `section/prefix*`, declares every name it matches)."""
    families = [m[:-1] for m in METRICS if m.endswith("*")]
    unknown = [key for key in row if key not in METRICS and not any(key.startswith(f) for f in families)]
    if unknown:
        raise KeyError(f"metrics {unknown} are not declared in harness.metrics; declare each as a Metric there")


def markdown_table() -> str:
    """The metrics table of docs/outputs.md."""
    lines = ["| metric | unit | logged on | meaning |", "|---|---|---|---|"]
    for m in METRICS.values():
        lines.append(f"| `{m}` | {m.unit or '–'} | {m.when} | {m.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
