"""Replica groups that survive each other (`fault_tolerance=torchft`): a real
torchft lighthouse and Managers, real replica groups as processes, real SIGKILLs
sent to a group's rank found by its REPLICA_GROUP_ID, as an external fault
injector would."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import TRAIN, assert_bitwise_equal, base_env, check_ok, read_metrics, saved_state

TIMEOUT_S = 20  # a collective's, and a process group's setup (the worst wait a kill can cost the survivors)
FT = [
    "fault_tolerance=torchft",
    "launcher.nproc=2",
    "sharding=no_shard",
    "model=mlp",
    "train.batch_size=4",
    "train.seq_len=16",
    "train.log_every=1",
    "train.steps=120",
    "optimizer=adamw",
    f"fault_tolerance.timeout_s={TIMEOUT_S}",
]
AVERAGERS = {
    # torchft's fault-tolerant HSDP: every step's gradients cross the groups; one thread per rank, so that
    # every run of it computes alike (the equivalence with one world and with torchft's DDP)
    "synchronous": ["averager=none", "dist.threads_per_rank=1", "checkpoint=full"],
    "periodic": ["averager=periodic", "averager.warmup_steps=4", "averager.period=4"],
    # local steps balanced by time, group 1 slowed (HARNESS_TEST_SLOWDOWN in the test's environment: its compute
    # padded to 0.3 s a step, several times group 0's step, and a period of its steps well inside a collective's
    # timeout; 20x its own compute was that on a quiet host, and past the timeout on a loaded one)
    "periodic_balanced": ["averager=periodic", "averager.warmup_steps=4", "averager.period=4", "averager.balance=time"],
    # Streaming DiLoCo's fragments, group 1 slowed as above; each sync applied a step after it starts (the slowed
    # group's one step per stride: at once), its figures summed at the next exchange; adacomm too
    "streaming_balanced": [
        "averager=diloco",
        "averager.warmup_steps=4",
        "averager.period=8",
        "averager.fragments=2",
        "averager.sync_delay=1",
        "averager.balance=time",
        "averager.period_schedule=adacomm",
    ],
    "streaming_diloco": [  # in 8 bits, and saving: the kill is aimed inside one of group 1's saves
        "averager=diloco",
        "averager.warmup_steps=4",
        "averager.period=8",
        "averager.fragments=2",
        "averager.sync_delay=1",
        "averager.comm_dtype=int8",
        "checkpoint=sharded",
        "checkpoint.interval=4",
    ],
}


KILL_SCOPE = "HARNESS_TEST_KILL_SCOPE"  # in the environment of this test's run only


def group_ranks(group: int, scope: Path) -> list[int]:
    """Pids of the training ranks of replica group `group`, found as an external fault injector
    would: by REPLICA_GROUP_ID in their environment (/proc/<pid>/environ); the ranks are the
    processes that have it and whose parent (the group's supervisor) has it too. Only the run
    started with KILL_SCOPE=`scope`: other tests' and benches' replica groups run alongside."""
    wanted = {f"REPLICA_GROUP_ID={group}".encode(), f"{KILL_SCOPE}={scope}".encode()}

    def in_group(pid: str) -> bool:
        try:
            return wanted <= set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            return False

    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and in_group(entry.name) and in_group(parent(entry.name)):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def parent(pid: str | int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]


def wait_for_step(rows_file: Path, step: int, proc: subprocess.Popen, timeout: float, uneven: bool = False) -> None:
    """Until a row at `step` or later (averager.balance=time logs only where the replicas meet); with
    `uneven`, an exchange's row at which group 1 took fewer local steps than group 0."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = rows_file.read_text().splitlines() if rows_file.exists() else []
        rows = [json.loads(line) for line in lines if line.endswith("}")]
        if any(row["step"] >= step and (not uneven or is_uneven(row)) for row in rows):
            return
        assert proc.poll() is None, f"the run ended before step {step}:\n{proc.communicate()[1][-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no step {step}{' of uneven plans' * uneven} in {rows_file} within {timeout} s")


def is_uneven(row: dict) -> bool:
    """An exchange at which group 1 took fewer local steps than group 0 (balance=time planned them so)."""
    return row.get("replica/local_steps/1", 0) < row.get("replica/local_steps/0", 0)


def wait_for_a_save(checkpoints: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Return while a save of this group is under way (a step_<N>.partial), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoints.is_dir() and any(p.name.endswith(".partial") for p in checkpoints.iterdir()):
            return
        time.sleep(0.002)


def wait_for_line(log: Path, text: str, count: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count(text) >= count:
            return
        assert proc.poll() is None, f"the run ended first:\n{proc.communicate()[1][-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not {count} times in {log} within {timeout} s")


def test_a_heal_state_is_staged_in_one_buffer_of_its_exact_size_reused_until_released():
    """HostStaging copies a heal state into one flat host buffer per dtype (each tensor at an aligned offset,
    so the buffers are the state's size plus at most ALIGN bytes a tensor), which torchft's HTTP transport
    serves (it refuses views of one storage as two dtypes), reuses them while the layout stays the same,
    and frees them on `release`. The transport, which serves the buffers' views, is stopped first:
    with no commit since the heal (a join quorum, then local steps) a late request for the staged step
    either gets that state or fails, never a copy half overwritten by the next heal or freed memory read
    as zeros. (On CUDA it is page-locked and the copies wait for the training stream: see
    HostStaging.stage; no CPU test can show that order.)"""
    import urllib.error
    from datetime import timedelta

    import torch
    from torchft.checkpointing import HTTPTransport

    from harness.fault_tolerance.replica_group import HostStaging

    state = {"step": 7, "model": {"w": torch.randn(3, 5), "b": torch.arange(3.0)}, "n": torch.tensor(4)}
    state["optim"] = {"state": {"w": {"exp_avg": torch.randn(3, 5).bfloat16(), "step": torch.tensor(2.0)}}}
    wait = timedelta(seconds=0.3)  # how long the transport keeps a request waiting for a state to serve
    transport = HTTPTransport(timeout=wait, num_chunks=0)
    try:
        staging = HostStaging(training_stream=None, transport=transport)

        def heal(step: int) -> dict:  # what torchft's Manager does with the staged state at a quorum
            staged = staging.stage(state)
            transport.send_checkpoint(dst_ranks=[1], step=step, state_dict=staged, timeout=wait)
            return staged

        def fetch(step: int) -> dict:  # a healing peer's request
            address = transport.metadata()
            return transport.recv_checkpoint(src_rank=0, metadata=address, step=step, timeout=timedelta(seconds=10))

        staged = heal(5)
        tensors = [state["model"]["w"], state["model"]["b"], state["n"], *state["optim"]["state"]["w"].values()]
        assert staging.nbytes == sum(t.numel() * t.element_size() for t in tensors)
        held = sum(flat.numel() * flat.element_size() for flat in staging.flats)
        assert staging.nbytes <= held <= staging.nbytes + len(tensors) * HostStaging.ALIGN
        assert [flat.dtype for flat in staging.flats] == [torch.float32, torch.int64, torch.bfloat16]
        assert staged["step"] == 7 and torch.equal(staged["optim"]["state"]["w"]["exp_avg"], tensors[3])
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(staging.buffers, tensors))
        sent = {k: v.clone() for k, v in state["model"].items()}
        assert all(torch.equal(fetch(5)["model"][k], v) for k, v in sent.items())
        state["model"]["w"].add_(1)  # training goes on: the staged copy stays as it was
        assert not torch.equal(staged["model"]["w"], state["model"]["w"])
        flats = staging.flats
        staging.stage(state)  # the next heal's copy, into the same buffer, before torchft sends it

        def served_or_refused(step: int, expected: dict) -> None:
            try:
                got = fetch(step)["model"]
            except urllib.error.HTTPError as e:  # the transport serves nothing now: the request fails
                assert e.code == 500, e
                return
            for k, v in expected.items():
                assert torch.equal(got[k], v), f"step {step}: {k} served with HTTP 200 is not the state sent: {got[k]}"

        served_or_refused(5, sent)
        transport.send_checkpoint(dst_ranks=[1], step=6, state_dict=staging.stage(state), timeout=wait)
        assert staging.flats is flats and torch.equal(fetch(6)["model"]["w"], state["model"]["w"])
        sent = {k: v.clone() for k, v in state["model"].items()}
        staging.release()  # the next quorum has no peer to heal, and no commit came between
        assert all(flat.untyped_storage().nbytes() == 0 for flat in flats) and staging.flats == []
        served_or_refused(6, sent)
        state["model"]["w"] = torch.randn(4, 5)  # another layout: a buffer of its own size
        assert torch.equal(heal(8)["model"]["w"], state["model"]["w"])
        assert torch.equal(fetch(8)["model"]["w"], state["model"]["w"])
    finally:
        transport.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("averager", sorted(AVERAGERS))
def test_a_killed_replica_group_heals_while_the_other_trains_on(tmp_path, averager):
    """Group 1's rank is SIGKILLed mid-run (with periodic, again while its restart joins, during
    its quorum and heal): group 0 never stops or redoes a step (one row per step, no resume, no
    long wait); group 1 alone is restarted, heals from group 0 at a quorum and then holds bit
    for bit the state group 0 sent; both finish, in one run that exits 0. Synchronous groups
    (averager=none) log every step and end on one model, bit for bit. With balance=time group 1 is
    several times slower, and the kill falls once the groups' plans differ (group 1 planned fewer local
    steps: before, a group's step time held its wait in the quorum, and plans stayed equal); the restarted
    group is healed into a period of uneven plans, and they are uneven again after it."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), *FT, *AVERAGERS[averager], f"hydra.run.dir={run_dir}"],
        env={
            **base_env(tmp_path),
            "HARNESS_HEAL_DIGEST": "1",
            KILL_SCOPE: str(tmp_path),
            **({"HARNESS_TEST_SLOWDOWN": "1:0.3s"} if averager.endswith("_balanced") else {}),
        },
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        balanced = averager.endswith("_balanced")
        wait_for_step(run_dir / "replica_group_1" / "metrics.jsonl", 12, proc, timeout=240, uneven=balanced)
        if averager == "streaming_diloco":
            wait_for_a_save(run_dir / "replica_group_1" / "checkpoints", proc, timeout=30)
        victims = group_ranks(1, tmp_path)
        assert victims, "no rank of replica group 1 found by REPLICA_GROUP_ID"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        if averager == "periodic":  # and again while the restarted group joins: built, at its quorum and heal
            wait_for_line(run_dir / "logs" / "rank1.log", "replicas:", 2, proc, timeout=240)
            for pid in group_ranks(1, tmp_path):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    check_ok(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert "replica group 1 failed" in stderr and "restarting it (1 of 3)" in stderr
    if averager == "periodic":
        assert "restarting it (2 of 3)" in stderr

    survivor = read_metrics(run_dir / "replica_group_0")
    steps = [row["step"] for row in survivor]
    assert steps == sorted(set(steps)) and steps[-1] == 120, "the survivor redid or skipped a step"
    if averager == "synchronous":  # a quorum every step: a row every step, a skipped one too
        assert steps == list(range(1, 121))
    assert all("run/resumed_from_step" not in row for row in survivor)
    assert survivor[-1]["ft/heals"] == 0 and survivor[-1]["ft/replicas"] == 2
    # around a failure the survivor waits for the lighthouse to give up on the dead group (heartbeat_timeout_s,
    # 0.5 s); a group killed after asking for a quorum is still in it, and the survivors' new process group
    # waits for it until timeout_s (docs/failures.md); never for a restart of its own
    slowest = max(row.get("ft/quorum_s", 0.0) for row in survivor)
    assert slowest < TIMEOUT_S + 30, f"the survivor waited {slowest:.1f} s at a quorum"  # + load

    healed = read_metrics(run_dir / "replica_group_1")
    assert healed[-1]["ft/heals"] >= 1 and healed[-1]["step"] == 120
    assert any("ft/heal_s" in row for row in healed)
    if balanced:
        heal = min(row["step"] for row in healed if "ft/heal_s" in row)
        assert any(is_uneven(row) and row["step"] > heal for row in survivor), "plans equal after the heal"
        # harness.report draws each group's local steps and waits (it drew the quorums and losses only), from the
        # groups' files together: while group 1 was down, group 0's rows
        from harness.report import read_replica_groups, replica_groups_figure

        figure = replica_groups_figure(read_replica_groups(run_dir), run_dir.name)
        lines = {ax.get_title(): {line.get_label(): line for line in ax.get_lines()} for ax in figure.axes}
        for title in ("Local steps per period, by replica", "Wait at each exchange for the last replica"):
            assert {"replica group 0", "replica group 1"} <= set(lines[title]), lines
        drawn = lines["Local steps per period, by replica"]["replica group 1"].get_xydata().tolist()
        logged = [[row["step"], row["replica/local_steps/1"]] for row in survivor if "replica/local_steps/1" in row]
        assert logged and all(point in drawn for point in logged), (logged, drawn)

    for group in (0, 1):  # a save cut short is never taken for a checkpoint
        saved = run_dir / f"replica_group_{group}" / "checkpoints"
        if saved.exists():
            done = [p for p in saved.iterdir() if not p.name.endswith(".partial")]
            assert done and all((p / "meta.json").is_file() for p in done)
            assert max(int(p.name.split("_")[1]) for p in done) == 120

    if averager == "synchronous":  # after the heal the groups train as one: one model at the end
        final = [saved_state(run_dir / f"replica_group_{g}" / "checkpoints" / "step_120", tmp_path) for g in (0, 1)]
        assert_bitwise_equal(*({part: state[part] for part in ("model", "optim")} for state in final))

    # heal exactness: the digest of what group 0 sent equals the digest of group 1's state after loading it
    logs = (run_dir / "train.log").read_text() + (run_dir / "logs" / "rank1.log").read_text()
    # the two groups share this machine's cores (before: each took them all, 5-10x slower a step with 4 groups)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert logs.count(f"device cpu, {threads} thread(s)") >= 3, "a group's ranks not given their share of the cores"
    sent = dict(re.findall(r"sending the heal state of step (\d+) \(digest (\w+)\)", logs))
    received = re.findall(r"healed from a live peer at step (\d+) \(digest (\w+)\)", logs)
    assert received, "group 1 logged no heal"
    for step, value in received:
        assert sent.get(step) == value, f"heal at step {step}: sent {sent.get(step)}, holds {value}"


@pytest.mark.slow
@pytest.mark.parametrize("node", ["back", "lost for good"])
def test_a_group_back_after_its_peers_finished_stops_at_once(node, tmp_path):
    """Group 1's node is lost (its supervisor stopped, its rank SIGKILLed) and comes back after group 0
    has finished: the restarted group finds no one to heal from and stops at once, instead of waiting
    quorum_timeout_s (300 s) at its first quorum and training on alone; the run exits 0. Lost for good
    (its supervisor SIGKILLed, so no restart can happen): group 0 trains every step alone, the run says
    what happened to group 1 and that the model is complete, and exits 3 (finished without a group)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), *FT, *AVERAGERS["periodic"], f"hydra.run.dir={run_dir}"],
        env={**base_env(tmp_path), KILL_SCOPE: str(tmp_path)},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    supervisor = None
    try:
        wait_for_step(run_dir / "replica_group_1" / "metrics.jsonl", 12, proc, timeout=240)
        ranks = group_ranks(1, tmp_path)
        assert ranks, "no rank of replica group 1 found by REPLICA_GROUP_ID"
        supervisor = int(parent(ranks[0]))
        # the group cannot restart until its node is back, or ever
        os.kill(supervisor, signal.SIGSTOP if node == "back" else signal.SIGKILL)
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        if node == "lost for good":
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 3, stderr[-3000:]
            told = stdout + stderr
            assert "replica group 1 was lost: its supervisor died of SIGKILL, so it could not be restarted" in told
            assert "training finished without replica group(s) 1" in told
            assert "The run's model is complete: replica group(s) 0 trained all 120 steps" in told
            assert [row["step"] for row in read_metrics(run_dir / "replica_group_0")] == list(range(1, 121))
            return
        wait_for_step(run_dir / "replica_group_0" / "metrics.jsonl", 120, proc, timeout=240)
        deadline = time.monotonic() + 60
        while not (run_dir / "replica_group_0" / "finished.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(supervisor, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=240)  # well within quorum_timeout_s
    finally:
        if supervisor is not None:
            with contextlib.suppress(ProcessLookupError):  # never left stopped
                os.kill(supervisor, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    check_ok(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert "replica group 1 failed" in stderr and "restarting it (1 of 3)" in stderr
    restarted = (run_dir / "logs" / "rank1.log").read_text()
    assert "restarted after replica group 0 finished training (step 120)" in restarted
    assert [row["step"] for row in read_metrics(run_dir / "replica_group_0")] == list(range(1, 121))
    assert read_metrics(run_dir / "replica_group_1")[-1]["step"] < 120, "group 1 trained on alone"


def start_torchrun_group(
    group: int, groups: int, lighthouse: str, args: list[str], env: dict, cwd: Path, entry: Path = TRAIN, restarts=1
):
    """One replica group as its own `torchrun` (its own rendezvous), as on another machine."""
    env = {**env, "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(groups), "TORCHFT_LIGHTHOUSE": lighthouse}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", str(restarts)]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(entry), *args]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_torchrun_groups(steps: int, run_dir: Path, tmp_path: Path) -> None:
    from torchft.coordination import LighthouseServer

    # the harness's defaults for 2 groups
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=500)
    args = [a for a in FT if not a.startswith(("launcher.", "train.steps"))] + AVERAGERS["periodic"]
    args += [f"train.steps={steps}", "checkpoint=sharded", "checkpoint.interval=8", f"hydra.run.dir={run_dir}"]
    try:
        groups = [start_torchrun_group(g, 2, lighthouse.address(), args, base_env(tmp_path), tmp_path) for g in (0, 1)]
        for group in groups:
            stdout, stderr = group.communicate(timeout=400)
            check_ok(subprocess.CompletedProcess(group.args, group.returncode, stdout, stderr))
    finally:
        lighthouse.shutdown()


@pytest.mark.slow
def test_two_torchrun_groups_share_a_lighthouse_and_a_whole_job_restart_resumes(tmp_path):
    """The multi-node form on one host: one lighthouse, one torchrun per replica group. The job
    stopped after its save at step 16 (its groups' checkpoints as it left them) and started again
    (lighthouse and all) resumes each group from its own newest checkpoint and ends where the
    uninterrupted job ends, loss for loss."""
    whole, restarted = tmp_path / "whole", tmp_path / "restarted"
    run_torchrun_groups(24, whole, tmp_path)
    for log, group in ((whole / "train.log", 0), (whole / "logs" / "rank1.log", 1)):  # each group its own log
        steps = [int(s) for s in re.findall(r"\] - step (\d+)/24 \|", log.read_text())]
        assert steps == list(range(1, 25)), f"group {group}'s progress lines in {log.name}: {steps}"
    for group in (0, 1):
        checkpoints = Path("checkpoints") / "step_16"
        shutil.copytree(
            whole / f"replica_group_{group}" / checkpoints, restarted / f"replica_group_{group}" / checkpoints
        )
    run_torchrun_groups(24, restarted, tmp_path)
    for group in (0, 1):
        rows = read_metrics(restarted / f"replica_group_{group}")
        assert [r["run/resumed_from_step"] for r in rows if "run/resumed_from_step" in r] == [16]
        assert rows[-1]["ft/replicas"] == 2 and rows[-1]["ft/heals"] == 0
        expected = {
            r["step"]: r["train/loss"] for r in read_metrics(whole / f"replica_group_{group}") if "train/loss" in r
        }
        resumed = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r and r["step"] > 16}
        assert resumed == {s: expected[s] for s in range(17, 25)}


def run_three_groups_one_dying(args: list[str], env: dict, dying: dict, min_replicas: int, tmp_path: Path) -> None:
    """Three torchrun groups on a lighthouse of `min_replicas`; group 2 runs tests/probes/dies_in_exchange.py
    with `dying` in its environment and one restart. Every group must exit 0."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=10000, heartbeat_timeout_ms=500
    )
    probe = Path(__file__).parent / "probes" / "dies_in_exchange.py"
    groups = []
    try:
        groups += [start_torchrun_group(g, 3, lighthouse.address(), args, env, tmp_path, restarts=0) for g in (0, 1)]
        groups.append(start_torchrun_group(2, 3, lighthouse.address(), args, {**env, **dying}, tmp_path, probe, 1))
        results = [(group, *group.communicate(timeout=400)) for group in groups]
    finally:
        for group in groups:
            if group.poll() is None:
                group.kill()
        lighthouse.shutdown()
    for group, stdout, stderr in results:
        check_ok(subprocess.CompletedProcess(group.args, group.returncode, stdout, stderr))


@pytest.mark.slow
@pytest.mark.parametrize("averager", ["periodic", "streaming_diloco"])
def test_a_group_lost_in_the_last_exchange_leaves_the_survivors_one_averaged_model(tmp_path, averager):
    """Three torchrun groups; group 2 dies inside the exchange of the run's last step, which no later
    sync can take in (opened by that step's quorum; Streaming DiLoCo's syncs every fragment, the one in
    flight applied before it): the two survivors redo it among themselves (a quorum of the last one's
    members) and end with one model, bit for bit, in their final checkpoints, not each its own; group
    2's restart finds the run finished and stops (exit 0)."""
    run_dir = tmp_path / "run"
    args = [a for a in FT if not a.startswith(("launcher.", "train.steps"))] + AVERAGERS[averager]
    args += ["train.steps=21", f"hydra.run.dir={run_dir}"]
    if averager == "periodic":
        args += ["checkpoint=sharded", "checkpoint.interval=100"]
    env = base_env(tmp_path)
    run_three_groups_one_dying(args, env, {"HARNESS_TEST_DIE_AT_STEP": "21"}, 1, tmp_path)
    restarted = (run_dir / "logs" / "rank2.log").read_text()  # back once its peers finished: it trains nothing
    assert "already complete at step 21" in restarted or "replica group 2 restarted after replica group" in restarted
    assert "step 21/21" not in restarted

    saved = [run_dir / f"replica_group_{g}" / "checkpoints" / "step_21" for g in (0, 1)]
    final = [saved_state(step_dir, tmp_path) for step_dir in saved]
    meta = [json.loads((step_dir / "meta.json").read_text())["cross_replica"] for step_dir in saved]
    assert_bitwise_equal(*(f["model"] for f in final))  # the exchange at step 21 sets the whole model
    if averager == "streaming_diloco":
        assert_bitwise_equal(*(f["parts"]["cross_replica"]["params"] for f in final))  # θ_outer, every fragment
    assert meta[0]["replica_link"] == meta[1]["replica_link"], "the survivors committed different exchanges"
    logs = (run_dir / "train.log").read_text() + (run_dir / "logs" / "rank1.log").read_text()
    assert logs.count("redoing it among the 2 replica groups left") == 2, logs[-3000:]
    for group in (0, 1):
        rows = read_metrics(run_dir / f"replica_group_{group}")
        assert rows[-1]["step"] == 21 and rows[-1]["ft/replicas"] == 2


@pytest.mark.slow
def test_synchronous_groups_agree_bit_for_bit_after_a_kill_inside_the_gradient_all_reduce(tmp_path):
    """averager=none, three torchrun groups; group 2 SIGKILLs itself inside step 10's gradient all-reduce,
    once its side has started, so a survivor may hold part of its data: one survivor may commit the step
    while the other does not, and they would fork. The lighthouse forms quorums of all three only (its
    min_replicas=3: the survivors wait at step 11 for group 2's restart, so the test does not depend on
    who is quick). Each survivor logs every step once (a skipped step is a row too) and exits 0; at step
    11's quorum the restarted group 2, and a survivor that did not commit step 10 while the other did,
    are healed from a live peer, bit for bit (by digest); all three end on one model and optimizer state,
    bit for bit."""
    run_dir = tmp_path / "run"
    args = [a for a in FT if not a.startswith(("launcher.", "train.steps"))] + AVERAGERS["synchronous"]
    args += ["train.steps=20", f"hydra.run.dir={run_dir}"]
    env = {**base_env(tmp_path), "HARNESS_HEAL_DIGEST": "1"}
    dying = {"HARNESS_TEST_DIE_AT_STEP": "10", "HARNESS_TEST_DIE_IN": "all_reduce"}
    run_three_groups_one_dying(args, env, dying, 3, tmp_path)
    rows = [read_metrics(run_dir / f"replica_group_{group}") for group in range(3)]
    for survivor in rows[:2]:
        assert [row["step"] for row in survivor] == list(range(1, 21)), "a survivor skipped or redid a row"
        assert survivor[-1]["ft/replicas"] == 3 and survivor[-1]["ft/skipped_steps"] <= 1
    assert rows[2][-1]["ft/heals"] == 1 and rows[2][-1]["step"] == 20
    skipped = [survivor[-1]["ft/skipped_steps"] for survivor in rows[:2]]

    final = [saved_state(run_dir / f"replica_group_{g}" / "checkpoints" / "step_20", tmp_path) for g in range(3)]
    for state in final[1:]:
        assert_bitwise_equal(*({part: s[part] for part in ("model", "optim")} for s in (final[0], state)))

    logs = "".join((run_dir / name).read_text() for name in ("train.log", "logs/rank1.log", "logs/rank2.log"))
    sent = dict(re.findall(r"sending the heal state of step (\d+) \(digest (\w+)\)", logs))
    received = re.findall(r"healed from a live peer at step (\d+) \(digest (\w+)\)", logs)
    # group 2, and the survivor that skipped step 10 if the other committed it (the fork)
    assert len(received) == 1 + (skipped[0] != skipped[1]), received
    for step, value in received:
        assert step == "10" and sent.get(step) == value, f"heal at step {step}: sent {sent.get(step)}, holds {value}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["no_shard", "hybrid_shard"])
def test_synchronous_groups_train_what_one_world_and_torchft_ddp_train(tmp_path, layout):
    """Without failures, two synchronous replica groups (`fault_tolerance=torchft averager=none`) end
    on the parameters, bit for bit, of the same layout in one world without fault tolerance: a rank per
    group (no_shard), or FSDP2 over 2 ranks in each group against native HSDP (hybrid_shard, 2 x 2); and
    of torchft's own DistributedDataParallel and OptimizerWrapper over real Managers and a lighthouse
    (tests/probes/torchft_ddp.py) given the same model, batches and optimizer (no_shard: its layout)."""
    import torch
    from torchft.coordination import LighthouseServer

    common = [a for a in FT if not a.startswith(("fault_tolerance", "train.steps"))] + AVERAGERS["synchronous"]
    common += ["train.steps=10", "train.grad_clip=0"]
    if layout == "hybrid_shard":
        common = [a for a in common if not a.startswith(("sharding=", "launcher.nproc"))]
        common += ["sharding=hybrid_shard", "sharding.replicate=2", "launcher.nproc=4"]
    env = base_env(tmp_path)
    check_ok(run_train(["fault_tolerance=torchft", *common], tmp_path / "ft", env, tmp_path))
    check_ok(run_train(common, tmp_path / "one_world", env, tmp_path))
    one_world = torch_load(tmp_path / "one_world" / "checkpoints" / "step_10" / "full.pt")
    ours = [torch_load(tmp_path / "ft" / f"replica_group_{r}" / "checkpoints" / "step_10" / "full.pt") for r in (0, 1)]
    for group in ours:
        assert group.keys() == one_world.keys()
        assert all(torch.equal(value, one_world[name]) for name, value in group.items()), "not one world's"
    if layout == "hybrid_shard":
        return
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, heartbeat_timeout_ms=500)
    probe = Path(__file__).parent / "probes" / "torchft_ddp.py"
    try:
        replicas = [
            subprocess.Popen(
                [sys.executable, str(probe), str(tmp_path / f"torchft_{r}.pt"), str(r), "2", lighthouse.address()]
                + common,
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in (0, 1)
        ]
        for replica in replicas:
            stdout, stderr = replica.communicate(timeout=300)
            check_ok(subprocess.CompletedProcess(replica.args, replica.returncode, stdout, stderr))
    finally:
        lighthouse.shutdown()
    for r, group in enumerate(ours):
        theirs = torch.load(tmp_path / f"torchft_{r}.pt", weights_only=True)["params"]
        assert group.keys() == theirs.keys()
        assert all(torch.equal(value, theirs[name]) for name, value in group.items()), "not torchft's"


@pytest.mark.slow
@pytest.mark.parametrize("failing", ["collectives", "quorums", "lighthouse"])
def test_a_run_whose_exchanges_never_commit_fails_naming_the_cause(tmp_path, failing):
    """No exchange across the groups commits, so each group stops with one paragraph naming the cause and
    the fix, is not restarted, and the run fails (it used to skip every step and exit 0, or restart the
    group whose quorum failed):
    - collectives: fault_tolerance.timeout_s=0.001 (should_commit's request, and at times the quorum's,
      time out too);
    - quorums: the lighthouse wants more groups than there are (its own --min_replicas), so no quorum
      forms; each group asks again, and stops after fault_tolerance.max_failed_exchanges in a row;
    - lighthouse: SIGKILLed once both groups have trained, as when its machine dies; the first failed quorum
      finds it gone."""
    args = [a for a in FT if not a.startswith(("fault_tolerance.timeout_s", "train.steps"))]
    if failing == "collectives":
        # at the first failure: should_commit's own request may time out too, and below the bound the rank then
        # fails (it cannot tell whether its group committed), so the group would restart
        args += ["train.steps=40", "fault_tolerance.timeout_s=0.001", "fault_tolerance.max_failed_exchanges=1"]
        proc = run_train(args, tmp_path / "run", base_env(tmp_path), tmp_path)
        named = ["1 exchange in a row across replica groups did not commit", "fault_tolerance.timeout_s=0.001 s"]
    else:
        serve = (  # in a process of its own, to be SIGKILLed as when its machine dies
            "import time; from torchft.coordination import LighthouseServer; "
            f"lighthouse = LighthouseServer(bind='[::]:0', min_replicas={3 if failing == 'quorums' else 1}, "
            "heartbeat_timeout_ms=500); print(lighthouse.address(), flush=True); time.sleep(600)"
        )
        lighthouse = subprocess.Popen(
            [sys.executable, "-c", serve], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        address = lighthouse.stdout.readline().strip()
        args += ["train.steps=100000", "fault_tolerance.quorum_timeout_s=1", "fault_tolerance.max_failed_exchanges=3"]
        args += [f"fault_tolerance.lighthouse={address}"]
        out, err = (tmp_path / "stdout").open("w+"), (tmp_path / "stderr").open("w+")  # a pipe could fill and stop it
        try:
            train = subprocess.Popen(
                [sys.executable, str(TRAIN), *args, f"hydra.run.dir={tmp_path / 'run'}"],
                env=base_env(tmp_path), cwd=tmp_path, stdout=out, stderr=err, text=True,
            )  # fmt: skip
            deadline = time.monotonic() + 300
            if failing == "lighthouse":  # once both groups have trained (a late one would find no lighthouse;
                # either may be first: the other is healed to its step, so no one step shows in both)
                rows = [tmp_path / "run" / f"replica_group_{r}" / "metrics.jsonl" for r in (0, 1)]
                while time.monotonic() < deadline and not all(f.exists() and f.stat().st_size for f in rows):
                    time.sleep(0.2)
                lighthouse.kill()
            train.wait(timeout=300)
        finally:
            lighthouse.kill()
        proc = subprocess.CompletedProcess(train.args, train.returncode, *(f.seek(0) or f.read() for f in (out, err)))
        named = {
            "quorums": [
                "3 exchanges in a row across replica groups did not commit, the last for want of a quorum: no "
                "quorum within fault_tolerance.quorum_timeout_s=1.0 s",
                "Fix: raise fault_tolerance.quorum_timeout_s",
            ],
            "lighthouse": [f"the torchft lighthouse at {address} stopped answering (the connection is refused)"],
        }[failing]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert all(n in proc.stderr for n in named), proc.stderr[-3000:]
    assert "restarting it" not in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "frame #" not in proc.stderr, "no C++ stack either"


@pytest.mark.slow
def test_an_unreachable_lighthouse_fails_at_once_naming_it(tmp_path):
    """Nothing listens at the lighthouse URL: each group fails at once (a refused connection is known
    at once), not after fault_tolerance.timeout_s, with one message naming the lighthouse and the fix,
    and is not restarted (no restart mends a setting)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    args = [a for a in FT if not a.startswith("fault_tolerance.timeout_s")]
    args += ["train.steps=4", f"fault_tolerance.lighthouse={url}", "fault_tolerance.timeout_s=180"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *args, f"hydra.run.dir={tmp_path / 'run'}"],
        env=base_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert f"nothing listens at the torchft lighthouse address {url}" in proc.stderr, proc.stderr[-3000:]
    assert "restarting it" not in proc.stderr and "cannot run" in proc.stderr
    assert time.monotonic() - start < 120  # well before timeout_s, start-up on a loaded machine included


@pytest.mark.slow
def test_a_fault_tolerant_sweep_job_is_an_ordinary_run_for_every_tool(tmp_path):
    """A sweep job with fault_tolerance=torchft starts its own lighthouse and replica groups, as `python
    train.py` does; its run dir is then read as any run's: export (and generate, through it) takes the
    mean of the groups' models at their newest common step, `--group` one group's; a plain run in the
    same dir resumes from the groups' checkpoints, and a fault-tolerant run from a plain run's."""
    llama = ["model=llama", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.n_layer=1"]
    ft = [a for a in FT if not a.startswith(("train.steps", "model="))] + llama + AVERAGERS["periodic"]
    ft += ["averager.warmup_steps=2", "averager.period=2", "checkpoint=full", "checkpoint.interval=2"]
    env = base_env(tmp_path)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "-m", *ft, "train.steps=7", f"hydra.sweep.dir={sweep}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    check_ok(proc)
    job = sweep / "0"
    assert json.loads((job / "result.json").read_text())["status"] == "completed"
    for group in (0, 1):  # replica groups, not an ordinary 2-rank job
        assert read_metrics(job / f"replica_group_{group}")[-1]["ft/replicas"] == 2
    last = [torch_load(job / f"replica_group_{g}" / "checkpoints" / "step_7" / "full.pt") for g in (0, 1)]
    assert torch_equal(last[0]["output.weight"], last[1]["output.weight"]), "the run ends with an exchange: one model"
    for g in (0, 1):  # as a run stopped on its way: the groups' newest common checkpoint is step 6
        shutil.rmtree(job / f"replica_group_{g}" / "checkpoints" / "step_7")
    saved = [torch_load(job / f"replica_group_{g}" / "checkpoints" / "step_6" / "full.pt") for g in (0, 1)]
    assert not torch_equal(saved[0]["output.weight"], saved[1]["output.weight"]), "step 6 is local: groups differ"

    from safetensors.torch import load_file

    def exported(args: list[str], out: Path):
        check_ok(run_module("harness.export", [str(job), str(out), *args], env, tmp_path))
        return load_file(out / "model-00001-of-00001.safetensors")["lm_head.weight"]

    mean = (saved[0]["output.weight"] + saved[1]["output.weight"]) / 2
    assert float((exported([], tmp_path / "mean") - mean).abs().max()) < 1e-6
    assert json.loads((tmp_path / "mean" / "export.json").read_text())["replica_groups"] == 2
    assert torch_equal(exported(["--group", "1"], tmp_path / "one"), saved[1]["output.weight"])

    # a plain run in the fault-tolerant run's dir resumes from the groups' newest checkpoint
    plain = [a for a in ft if not a.startswith("fault_tolerance")]
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *plain, "train.steps=8", f"hydra.run.dir={job}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    check_ok(proc)
    assert "replica_group_" in proc.stdout.split("resumed from", 1)[1].split("\n", 1)[0]
    # one rule both ways: every replica starts from the mean of the copies (the groups' here), said in the log
    assert "resuming the 2 replica groups' checkpoints at step 6" in proc.stdout, proc.stdout[-3000:]
    assert "every replica starts from the mean of their models" in proc.stdout
    assert [row["step"] for row in read_metrics(job) if "train/loss" in row] == [7, 8]

    # and the other way round: a fault-tolerant run's groups resume from a plain run's checkpoint
    other = tmp_path / "other"
    check_ok(run_train([*plain, "train.steps=3"], other, env, tmp_path))
    proc = run_train([*ft, "train.steps=6"], other, env, tmp_path)
    check_ok(proc)
    assert "holds 2 replicas of one model (each with its own optimizer state)" in proc.stdout + proc.stderr
    # step 4 crosses no replicas (local, after the plain run's last exchange at 3), so a group that starts first
    # takes it alone and the other is healed to it at step 5's quorum
    trained = [
        [row["step"] for row in read_metrics(other / f"replica_group_{g}") if "train/loss" in row] for g in (0, 1)
    ]
    assert [4, 5, 6] in trained and all(steps in ([4, 5, 6], [5, 6]) for steps in trained), trained

    # one group's checkpoint cut short: an export names it and --group, not a resume's keys ...
    damaged = other / "replica_group_1" / "checkpoints" / "step_6"
    (damaged / "full.pt").write_bytes((damaged / "full.pt").read_bytes()[:4096])
    proc = run_module("harness.export", [str(other), str(tmp_path / "damaged")], env, tmp_path)
    assert proc.returncode == 2 and f"checkpoint {str(damaged)!r}: loading it failed" in proc.stderr, proc.stderr
    assert "--group <r>" in proc.stderr and "checkpoint.resume" not in proc.stderr and "Traceback" not in proc.stderr
    # ... and a fault-tolerant resume stops at once, naming it (it was restarted 3 times, each failing alike,
    # while the other group waited in its first quorum for up to quorum_timeout_s)
    proc = run_train([*ft, "train.steps=8"], other, env, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and f"replica group 1 cannot resume from its checkpoint {str(damaged)!r}" in out, out
    assert "Fix: remove that step_<N> directory" in out and "restarting it" not in out and "Traceback" not in out


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)["model"]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def run_module(module: str, args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def run_train(args: list[str], run_dir: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TRAIN), *args, f"hydra.run.dir={run_dir}"],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
