"""Hydra multirun sweeps of multi-rank jobs, their W&B runs and reports, and a
simulated two-node torchrun job. Real processes throughout: `python train.py
-m` starts each job's ranks itself; the two "nodes" are two torchrun agents
meeting at one c10d rendezvous."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.launch import free_port
from harness.report import main as report_main

from support import FAST, TRAIN, base_env, check_ok, read_metrics, run_cli
from wandb_reader import find_run_files, read_run

pytestmark = pytest.mark.slow
SWEEP = [*FAST, "averager.warmup_steps=2", "hydra.sweep.dir=sweep"]
MODELS = "model=mlp,llama"  # the report and W&B runs of a sweep over models, the Llama among them
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def results(sweep: Path) -> dict[int, dict]:
    return {r["job"]: r for r in (json.loads(p.read_text()) for p in sweep.glob("*/result.json"))}


def check_pngs(*paths: Path) -> None:
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 20_000, f"{path} is not a plotted PNG ({len(data)} bytes)"


def test_sweep_jobs_get_their_own_ranks_wandb_runs_and_one_report(tmp_path):
    env = base_env(tmp_path)
    env.pop("WANDB_MODE")  # the default: offline W&B runs in each job dir
    sweep_args = [a for a in SWEEP if a != "model=mlp"]
    proc = run_cli(["-m", *sweep_args, MODELS, "averager.period=2,4"], env, tmp_path)
    check_ok(proc)
    sweep = tmp_path / "sweep"
    names = {
        "model=mlp,averager.period=2",
        "model=mlp,averager.period=4",
        "model=llama,averager.period=2",
        "model=llama,averager.period=4",
    }
    assert "harness: sweep" in proc.stdout and "4 of 4 jobs completed" in proc.stdout
    assert proc.stdout.count("starting 2 local ranks") == 4
    assert (sweep / "multirun.yaml").exists()
    assert {r["name"] for r in results(sweep).values()} == names
    assert all(r["status"] == "completed" for r in results(sweep).values())

    runs = {}
    for job in range(4):
        job_dir = sweep / str(job)
        assert (job_dir / "logs" / "rank1.log").exists() and (job_dir / ".hydra" / "config.yaml").exists()
        (run_file,) = find_run_files(job_dir)  # exactly one W&B run per job, inside its own dir
        run = read_run(run_file)
        runs[run["run"]["display_name"]] = run
        assert run["run"]["group"] == "sweep"  # the sweep dir's name
        assert set(run["run"]["tags"]) == set(run["run"]["display_name"].split(","))
        assert run["run"]["display_name"].split(",")[0] in run["config"]["overrides"]
        # the run holds this job's rows and no other job's
        jsonl = [(row["step"], row.get("train/loss")) for row in read_metrics(job_dir)]
        logged = [(row["train/step"], row.get("train/loss")) for row in run["history"]]
        assert logged == jsonl
    assert set(runs) == names
    # W&B's own CLI sees four offline runs it would upload
    offline = sorted(str(p) for p in sweep.glob("*/wandb/offline-run-*"))
    sync = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", *offline],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sync.returncode == 0 and "Would sync 4 run(s)" in sync.stdout + sync.stderr, sync.stdout + sync.stderr
    period = {name: runs[name]["config"]["averager"]["period"] for name in names}
    assert period == {name: int(name[-1]) for name in names}

    assert report_main([str(sweep)]) == 0
    report = sweep / "report"
    with open(report / "jobs.csv") as f:
        table = list(csv.DictReader(f))
    assert {line["name"] for line in table} == names and all(line["status"] == "completed" for line in table)
    losses = [float(line["final loss"]) for line in table]
    assert losses == sorted(losses)
    assert all(float(line["cross-replica MB per rank"]) > 0 and float(line["training s"]) > 0 for line in table)
    assert all(name in (report / "jobs.md").read_text() for name in names)
    check_pngs(report / "loss.png", report / "tradeoff.png")

    assert report_main([str(sweep / "0")]) == 0
    check_pngs(sweep / "0" / "report" / "run.png")
    assert "model=mlp,averager.period=2" in (sweep / "0" / "report" / "summary.md").read_text()


def test_a_failing_job_fails_alone_and_the_sweep_exits_non_zero(tmp_path, cli_env):
    """Job 0: a value validate refuses (exit 2); job 1: NaN loss raised on the ranks (exit 1);
    jobs 2 and 3 run after them."""
    proc = run_cli(["-m", *SWEEP, "optimizer=sgd", "optimizer.lr=1e9,0.05", "averager.period=0,2"], cli_env, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    jobs = results(sweep)
    assert [jobs[j]["status"] for j in range(4)] == ["failed", "failed", "failed", "completed"]
    assert [jobs[j]["exit_code"] for j in range(4)] == [2, 1, 2, 0]
    assert "not finite" in jobs[1]["reason"] and "averager.period=0" in jobs[0]["reason"]
    assert len(read_metrics(sweep / "3")) == 8
    assert "1 of 4 jobs completed, failed: 0, 1, 2" in proc.stderr
    assert "job 1 (optimizer.lr=1000000000.0,averager.period=2) failed with exit 1" in proc.stderr

    assert report_main([str(sweep)]) == 0
    with open(sweep / "report" / "jobs.csv") as f:
        table = list(csv.DictReader(f))
    assert sorted(line["job"] for line in table) == ["0", "1", "2", "3"]
    assert table[0]["job"] == "3"  # the only job with a final loss sorts first
    assert all(line["failure"] for line in table[1:])


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


def test_a_killed_rank_fails_only_its_job(tmp_path, cli_env):
    sweep = [arg for arg in SWEEP if not arg.startswith("train.steps=")]
    cmd = [sys.executable, str(TRAIN), "-m", *sweep, "train.steps=100000,8"]
    proc = subprocess.Popen(cmd, env=cli_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "sweep" / "0" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    ranks = _children(proc.pid)
    assert len(ranks) == 2, f"expected job 0's two rank processes, found {ranks}"
    os.kill(ranks[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    jobs = results(tmp_path / "sweep")
    # the killed rank's peer may fail first (its collective breaks): torch reports whichever exited first
    assert jobs[0]["status"] == "failed" and jobs[0]["exit_code"] == 1 and "rank " in jobs[0]["reason"]
    assert jobs[1]["status"] == "completed" and len(read_metrics(tmp_path / "sweep" / "1")) == 8
    assert "1 of 2 jobs completed, failed: 0" in err


def test_remote_style_launcher_jobs_are_summarised_from_their_result_files(tmp_path, cli_env):
    """submitit_local runs each job in its own submitit process, as SLURM would: the
    summary can only come from the jobs' result.json files."""
    proc = run_cli(["-m", *SWEEP, "hydra/launcher=submitit_local", "averager.period=0,2"], cli_env, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "sweep" / ".submitit").is_dir()
    jobs = results(tmp_path / "sweep")
    assert [jobs[j]["status"] for j in range(2)] == ["failed", "completed"]
    assert "1 of 2 jobs completed, failed: 0" in proc.stderr


def test_two_nodes_shard_inside_a_node_and_average_across_nodes(tmp_path, cli_env):
    """Two torchrun agents (`--nnodes 2 --node-rank 0|1`, 2 ranks each) on one host:
    hybrid_shard's default layout is one replica per node, and the replicas
    (so the nodes) are averaged: their final copies are identical."""
    port = free_port()
    args = [
        *FAST,
        "train.steps=13",
        "averager.warmup_steps=4",
        "averager.period=4",
        "checkpoint=full",
        "checkpoint.interval=13",
        "hydra.run.dir=run",
    ]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--rdzv-id",
                "two-nodes",
                str(TRAIN),
                *args,
            ],
            env=cli_env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    for node in nodes:
        out, err = node.communicate(timeout=240)
        assert node.returncode == 0, out[-3000:] + err[-3000:]
    run = tmp_path / "run"
    log = (run / "train.log").read_text()
    assert "mesh {'replicate': 2, 'shard': 2}" in log
    assert "replica 0 = ranks [0, 1] on node 0; replica 1 = ranks [2, 3] on node 1" in log
    rows = read_metrics(run)
    averaged = [row["step"] for row in rows if row.get("averager/averaged")]
    assert averaged == [5, 9, 13]  # the last step averages, so both nodes end with one model
    assert all(row["averager/drift"] > 0 for row in rows if row.get("averager/averaged"))  # replicas had diverged
    step = run / "checkpoints" / "step_13"
    node0 = torch.load(step / "full.pt", weights_only=True)["model"]
    node1 = torch.load(step / "replica_1.pt", weights_only=True)["model"]
    assert node0.keys() == node1.keys()
    assert all(torch.equal(node0[k], node1[k]) for k in node0)
