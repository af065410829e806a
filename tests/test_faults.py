"""Fault injection with real processes and real signals: killed jobs and ranks
resume exactly, interrupted saves lose nothing, NaNs and hung ranks stop the run
with the cause."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from support import (
    REPO,
    SMALL,
    TRAIN,
    assert_bitwise_equal,
    check_ok,
    loss_by_step,
    read_metrics,
    run_cli,
    saved_state,
    steps_saved,
)

# big enough that a save takes a while (the kill must land inside one), small enough for 2 cores
MEDIUM = [
    "model=mlp",
    "model.d_model=256",
    "model.hidden=1024",
    "model.n_layer=4",
    "model.dropout=0.1",  # random numbers drawn in training: RNG states must resume exactly too
    "train.batch_size=4",
    "train.seq_len=16",
    "train.log_every=1",
]
LOCAL_SGD = [
    "launcher.nproc=2",
    "sharding=no_shard",
    "optimizer=adamw",
    "averager=periodic",
    "averager.warmup_steps=2",
    "averager.period=4",
]


def start(args: list[str], env: dict, torchrun_nproc: int | None = None) -> subprocess.Popen:
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun_nproc),
            "--max-restarts",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            str(TRAIN),
        ]
        if torchrun_nproc
        else [sys.executable, str(TRAIN)]
    )
    return subprocess.Popen(
        [*cmd, *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 180, poll: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = predicate()
        except ValueError:  # a metrics.jsonl line caught halfway through its write
            found = False
        if found:
            return found
        assert proc.poll() is None, f"exited {proc.returncode} early:\n{proc.stdout.read()[-3000:]}"
        time.sleep(poll)
    raise AssertionError("timed out waiting")


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("mode,victim", [("sharded", "job"), ("sharded_async", "rank"), ("full", "rank")])
def test_kill_during_a_save_then_rerun_resumes_from_the_previous_checkpoint_bitwise(mode, victim, tmp_path, cli_env):
    """SIGKILL the whole job, or one rank, while step 6 is being saved; the
    step-3 checkpoint stays complete, `resume=auto` skips the partial one, and
    the rerun of the same command cleans it up and ends bitwise equal to an
    uninterrupted run."""
    ckpt = ["checkpoint=sharded", "checkpoint.async=true"] if mode == "sharded_async" else [f"checkpoint={mode}"]
    schedule = ["lr_scheduler=warmup_cosine", "lr_scheduler.warmup_steps=4"]  # resumed inside the warmup
    args = [*MEDIUM, *LOCAL_SGD, *schedule, *ckpt, "checkpoint.interval=3", "checkpoint.keep=3", "train.steps=9"]
    a, b = tmp_path / "a", tmp_path / "b"
    check_ok(run_cli([*args, f"hydra.run.dir={a}"], cli_env, REPO))

    proc = start([*args, f"hydra.run.dir={b}"], cli_env)
    partial = b / "checkpoints" / "step_6.partial"
    wait_for(partial.exists, proc)
    if victim == "job":
        kill_group(proc)
    else:  # one rank dies; the launcher takes the others down and fails
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(workers[-1]), signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    assert steps_saved(b) == ["step_3", "step_6.partial"]
    before = {p.name: p.stat().st_mtime_ns for p in (b / "checkpoints" / "step_3").iterdir()}

    rerun = run_cli([*args, f"hydra.run.dir={b}"], cli_env, REPO)
    check_ok(rerun)
    assert "step_3 at step 3" in rerun.stdout and "removing incomplete checkpoint" in rerun.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (b / "checkpoints" / "step_3").iterdir()} == before
    assert steps_saved(b) == ["step_3", "step_6", "step_9"]
    assert_bitwise_equal(
        saved_state(a / "checkpoints" / "step_9", tmp_path), saved_state(b / "checkpoints" / "step_9", tmp_path)
    )
    assert loss_by_step(b) == loss_by_step(a)
    lrs = [{row["step"]: row["train/lr"] for row in read_metrics(run) if "train/lr" in row} for run in (a, b)]
    # 9 steps, 8 rates: the last warmup step and the first decay step both train at optimizer.lr
    assert lrs[0] == lrs[1] and len(set(lrs[0].values())) == 8, "the schedule continues exactly"
    steps = [row["step"] for row in read_metrics(b)]
    assert steps == sorted(steps), "metrics.jsonl keeps one ordered x-axis across the kill"


@pytest.mark.slow
def test_killed_rank_is_restarted_by_torchrun_and_the_run_ends_bitwise_equal(tmp_path, cli_env):
    args = [
        *SMALL,
        "sharding=no_shard",
        "optimizer=adamw",
        "averager=periodic",
        "averager.warmup_steps=2",
        "averager.period=4",
        "checkpoint=sharded",
        "checkpoint.interval=5",
        "train.steps=14",
        "model.dropout=0.1",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    check_ok(run_cli([*args, f"hydra.run.dir={a}"], cli_env, REPO, torchrun_nproc=2))

    proc = start([*args, f"hydra.run.dir={b}"], cli_env, torchrun_nproc=2)
    wait_for(
        lambda: (b / "checkpoints" / "step_5").exists() and any(row["step"] >= 7 for row in read_metrics(b)),
        proc,
        poll=0.01,
    )  # between averaging steps
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(workers[-1]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]

    assert_bitwise_equal(
        saved_state(a / "checkpoints" / "step_14", tmp_path), saved_state(b / "checkpoints" / "step_14", tmp_path)
    )
    rows = read_metrics(b)
    [resumed] = [r for r in rows if "run/resumed_from_step" in r]
    assert resumed["run/resumed_from_step"] == 5 and resumed["run/restarts"] == 1
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and loss_by_step(b) == loss_by_step(a)


# (optimizer.fused, sharding): the host's check on FSDP2; the device's (fused SGD has no DTensor kernel: one-device
# replicas, their gradients exchanged by the harness); the host's on DDP, whose comm hook keeps a step count of its own
NONFINITE_PATHS = {
    "checked on the host": ("false", "full_shard"),
    "skipped on the device": ("true", "no_shard"),
    "checked on the host, ddp": ("false", "ddp"),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", NONFINITE_PATHS)
def test_nonfinite_loss_stops_at_that_step_and_no_checkpoint_holds_it(path, tmp_path, cli_env):
    """A fused optimizer skips a non-finite step on the device (its `found_inf`), and the host reads
    the check on log, eval, save and averaging steps only; the for-loop SGD is checked every step.
    Both stop at the step (here every step logs and saves) or skip it alike, and a skipped step counts
    in every path: with 2 replicas the averaging schedule (warmup 2, period 2) averages after steps 3 and 5,
    and after the run's last, 6, whichever path skipped the steps between."""
    fused, sharding = NONFINITE_PATHS[path]
    run = tmp_path / "run"
    blowup = ["optimizer=sgd", "optimizer.lr=1e9", "train.grad_clip=0", f"sharding={sharding}"]
    blowup += ["averager=none"] if sharding == "full_shard" else ["averager.warmup_steps=2", "averager.period=2"]
    blowup += ["optimizer.fused=true"] if fused == "true" else []
    proc = run_cli(
        [*SMALL, *blowup, "train.steps=6", "checkpoint=sharded", "checkpoint.interval=1", f"hydra.run.dir={run}"],
        cli_env,
        REPO,
    )
    assert proc.returncode == 1
    assert "not finite (NaN/inf) at step 2" in proc.stdout and "train.nonfinite=skip" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr, "the rank the launcher stopped leaves with one line"
    assert steps_saved(run) == ["step_1"]
    saved = saved_state(run / "checkpoints" / "step_1", tmp_path)
    assert all(torch.isfinite(t).all() for t in saved["model"].values())

    skip = tmp_path / "skip"
    proc = run_cli(
        [
            *SMALL,
            *blowup,
            "train.steps=6",
            "train.nonfinite=skip",
            "checkpoint=sharded",
            "checkpoint.interval=1",
            "checkpoint.keep=6",
            f"hydra.run.dir={skip}",
        ],
        cli_env,
        REPO,
    )
    check_ok(proc)
    rows = read_metrics(skip)
    assert [r["step"] for r in rows if r.get("train/skipped_nonfinite")] == [2, 3, 4, 5, 6]
    # skipped steps leave the parameters as they were after step 1 (the replicas' mean of equal models too)
    assert_bitwise_equal(
        saved_state(skip / "checkpoints" / "step_6", tmp_path)["model"],
        saved_state(skip / "checkpoints" / "step_1", tmp_path)["model"],
    )
    if sharding != "full_shard":  # the skipped steps counted: the averager's schedule is the steps'
        assert [r["step"] for r in rows if r.get("averager/averaged")] == [3, 5, 6]
        assert rows[-1]["averager/step"] == 6
    if fused == "false":
        return
    # on the device, between log steps: the error surfaces at the next log step, naming the first bad step
    late = tmp_path / "late"
    every_4 = [o for o in SMALL if not o.startswith("train.log_every")] + ["train.log_every=4"]
    blowup = [o for o in blowup if not o.startswith("averager")] + ["averager=none"]
    proc = run_cli([*every_4, *blowup, "train.steps=6", f"hydra.run.dir={late}"], cli_env, REPO)
    assert proc.returncode == 1
    assert "not finite (NaN/inf) at step 2" in proc.stdout and "training stopped at step 4" in proc.stdout
    assert [r["step"] for r in read_metrics(late)] == [1]


@pytest.mark.slow
def test_a_rank_that_stops_responding_ends_the_job_after_dist_timeout(tmp_path, cli_env):
    run = tmp_path / "run"
    proc = start(
        [
            *SMALL,
            "averager=none",
            "sharding=full_shard",
            "train.steps=100000",
            "dist.timeout_s=5",
            f"hydra.run.dir={run}",
        ],
        cli_env,
    )
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2, proc, poll=0.05)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    stopped = int(workers[0])
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0
    assert time.monotonic() - started < 90
    logs = out + "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "did not finish within dist.timeout_s=5 s" in logs and "another rank stopped responding" in logs


def test_a_rank_stopped_as_it_leaves_says_so_in_one_line(tmp_path, cli_env):
    """A stop signal that lands after a rank's body, in a finalizer as it leaves (a replica group stopped by
    the launcher as its rank ended: torch.library's finalizers at exit), was raised there by torchelastic's
    handler, which every forked rank inherits, and printed as a traceback ('Exception ignored in ...'); the
    rank then left with the body's exit status. The rank's own handler says it was stopped, in one line, and
    leaves at once with 128 + the signal."""
    proc = run_cli([], cli_env, tmp_path, script=REPO / "tests" / "probes" / "stopped_while_leaving.py", timeout=60)
    check_ok(proc)
    assert "rank exit status: 143" in proc.stdout, proc.stdout
    assert proc.stderr.strip().splitlines() == ["the rank was stopped (SIGTERM)"], proc.stderr
