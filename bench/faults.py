"""Goodput under failures: replica groups that heal (`fault_tolerance=torchft`) against
today's answer, a whole-job restart from checkpoints (`torchrun --max-restarts`), with
the same failures, next to the same run without failures.

    python bench/faults.py                 # 2 and 4 groups, a SIGKILL every --every seconds
    python bench/faults.py --smoke         # 2 groups, one failure, a few steps

Each job is the real CLI in a subprocess: `python train.py fault_tolerance=torchft` (one
rank per replica group, DiLoCo, or with `--averager none` synchronous training: a quorum
and a gradient exchange across the groups every step), and `torchrun --max-restarts` over
the same ranks with `checkpoint=sharded` every few steps. A fault injector in this process
SIGKILLs one random rank (a random group's ranks, found by REPLICA_GROUP_ID) every `--every`
seconds of the job's wall time until one of its worlds has trained every step (or
`--failures` times), and only processes carrying this bench's marker in their environment:
each job runs at the same failure rate, so a job that recovers slowly also sees more
failures. Reported per job: useful tokens/s (the tokens the final model trained on, over
the wall time: a step redone counts once, and a killed group's steps after its last sync,
which died with it, the steps it missed while down, which no group trains, and a
synchronous step skipped because its exchange did not commit, count not at all),
failures, steps redone, steps skipped, the heals' time and memory (the sender's state
staged in host memory, reused from heal to heal; none on the device), the slowest step,
the median quorum (its share of the step without failures is reported on its own), the
final held-out loss. All step counts come
from the progress lines of each world's first rank (train.log_every=1). The three jobs
run back to back once per `--seeds` seed (a round); the ratios and each failure's cost
are given per round and as medians over the rounds, and the held-out loss with
failures against the failure-free runs' spread over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from flags import above, at_least, integers

REPO = Path(__file__).resolve().parents[1]
MARKER = "HARNESS_FAULTS_BENCH"  # only processes with this bench run's marker are ever killed


BATCH = {True: (4, 16), False: (8, 64)}  # (train.batch_size, train.seq_len) of the smoke and of the full size


def job_args(steps: int, period: int, smoke: bool, synchronous: bool) -> list[str]:
    batch, seq = BATCH[smoke]
    averager = ["averager=none"]
    if not synchronous:
        averager = ["averager=diloco", "averager.warmup_steps=0", f"averager.period={period}"]
    return [
        "model=mlp" if smoke else "model=gpt",
        f"train.batch_size={batch}",
        f"train.seq_len={seq}",
        "sharding=no_shard",
        *averager,
        f"train.steps={steps}",
        "train.log_every=1",
        f"train.eval_every={steps}",
        "train.eval_batches=4",
        "dist.threads_per_rank=1",
    ]


def environ(pid: str) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def parent(pid: str) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]


def victims(marker: str, fault_tolerant: bool) -> list[int]:
    """One failure's processes: a random replica group's ranks, or one random torchrun worker."""
    tag = f"{MARKER}={marker}".encode()
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = environ(entry.name)
            if tag not in env:
                continue
            if fault_tolerant:
                group = next((v for v in env if v.startswith(b"REPLICA_GROUP_ID=")), None)
                if group is not None and group in environ(parent(entry.name)):  # a rank, not its supervisor
                    found.setdefault(group.decode(), []).append(int(entry.name))
            elif any(v.startswith(b"LOCAL_RANK=") for v in env):  # a torchrun worker, not the agent
                found.setdefault(entry.name, []).append(int(entry.name))
        except OSError:
            continue
    return random.choice(list(found.values())) if found else []


def reached_step(run_dir: Path) -> int:
    """The furthest step any metrics.jsonl under the run dir has logged."""
    best = 0
    for rows in run_dir.rglob("metrics.jsonl"):
        for line in rows.read_text().splitlines():
            try:
                best = max(best, json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
    return best


def run_job(
    cmd: list[str],
    run_dir: Path,
    every: float | None,
    failures: int,
    fault_tolerant: bool,
    cwd: Path,
    steps: int,
    wandb_mode: str,
) -> dict:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "WANDB_MODE": wandb_mode, "PYTHONUNBUFFERED": "1"}
    env["PET_LOG_DIR"] = str(run_dir / "torchrun-logs")  # the baseline's torchrun logs in the run dir, not /tmp
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    kills: list[int] = []  # the step reached at each failure
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def inject() -> None:
        while len(kills) < failures and not stop.wait(every):
            reached = reached_step(run_dir)
            if reached == 0:  # not training yet: wait for the first step
                continue
            if reached >= steps:  # a world has finished: the run is over, a group killed now just stops
                return
            pids = victims(marker, fault_tolerant)
            if pids:
                kills.append(reached)
                for pid in pids:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass

    injector = threading.Thread(target=inject, daemon=True)
    if every is not None:
        injector.start()
    _, stderr = proc.communicate()
    stop.set()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench/faults.py: {' '.join(cmd[:4])} ... exited {proc.returncode}:\n{stderr[-3000:]}")
    return {"wall_s": wall, "kills": kills, "rows": read_rows(run_dir)}


def read_rows(run_dir: Path) -> dict[str, list[dict]]:
    return {
        str(path.parent.relative_to(run_dir)): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(run_dir.rglob("metrics.jsonl"))
    }


def attempts(log: Path) -> tuple[list[list[int]], int]:
    """The steps a world's first rank trained, one list per attempt (every attempt appends to
    the same log, and starts with its "world N, mesh ..." line), less the synchronous steps it
    skipped (their gradient exchange did not commit); and how many it skipped."""
    runs: list[list[int]] = []
    skipped: list[set[int]] = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if "] - world " in line:
            runs.append([])
            skipped.append(set())
        elif (step := re.search(r"\] - step (\d+)/\d+ \|", line)) and runs:
            runs[-1].append(int(step.group(1)))
        elif (step := re.search(r"\] - step (\d+): the gradient exchange .* step skipped", line)) and runs:
            skipped[-1].add(int(step.group(1)))  # its progress line follows: not kept
    kept = [[s for s in steps if s not in dropped] for steps, dropped in zip(runs, skipped)]
    return kept, sum(len(dropped) for dropped in skipped)


def kept_steps(runs: list[list[int]], period: int | None) -> tuple[set[int], int]:
    """(the steps whose training the final model keeps, steps trained more than once) for one world.
    `period`: a replica group's (fault tolerance), whose killed attempt loses its steps after its
    last sync, as they lived only in its memory (1: synchronous, every step a sync); None: a
    whole-job world, which resumes from a checkpoint and so redoes, and keeps, every step it trained."""
    kept: set[int] = set()
    trained = 0
    for i, steps in enumerate(runs):
        trained += len(steps)
        killed = i < len(runs) - 1
        if period is not None and killed and steps:
            last_sync = max(steps) // period * period
            steps = [s for s in steps if s <= last_sync]
        kept.update(steps)
    return kept, trained - len({s for steps in runs for s in steps})


def summarize(name: str, job: dict, tokens_per_group_step: int, groups: int, period: int, run_dir: Path) -> dict:
    rows = [row for group_rows in job["rows"].values() for row in group_rows]
    fault_tolerant = "torchft" in name
    logs = [run_dir / "train.log", *sorted((run_dir / "logs").glob("rank*.log"))]
    kept = redone = skipped = 0
    for log in logs:
        runs, not_committed = attempts(log)
        steps, again = kept_steps(runs, period if fault_tolerant else None)
        kept, redone, skipped = kept + len(steps), redone + again, skipped + not_committed
    replicas_per_world = 1 if fault_tolerant else groups  # a replica group's world, or the whole job's
    heals = [row["ft/heal_s"] for row in rows if "ft/heal_s" in row]
    sent = [row["ft/heal_sent_bytes"] for row in rows if "ft/heal_sent_bytes" in row]
    step_times = [row["train/step_time_s"] for row in rows if "train/step_time_s" in row and row["step"] > 1]
    quorums = [row["ft/quorum_s"] for row in rows if "ft/quorum_s" in row and row["step"] > 1]
    evals = [row["eval/loss"] for group_rows in job["rows"].values() for row in group_rows[-3:] if "eval/loss" in row]
    return {
        "job": name,
        "wall_s": job["wall_s"],
        "useful_tokens_per_s": kept * replicas_per_world * tokens_per_group_step / job["wall_s"],
        "failures": len(job["kills"]),
        "steps_redone": redone,
        "steps_skipped": skipped,  # synchronous steps whose exchange did not commit, summed over the groups
        "heal_s_median": statistics.median(heals) if heals else None,
        # a heal's extra memory on the sender: its state staged once in host memory, none on the device
        "heal_sent_mib": max(sent) / 2**20 if sent else None,
        "slowest_step_s": max(step_times) if step_times else None,
        "median_step_s": statistics.median(step_times) if step_times else None,
        "quorum_s_median": statistics.median(quorums) if quorums else None,
        "eval_loss": statistics.fmean(evals) if evals else None,
    }


def measure(groups: int, args: argparse.Namespace, work: Path) -> list[dict]:
    steps, smoke = args.steps, args.smoke
    synchronous = args.averager == "none"
    base = job_args(steps, args.period, smoke, synchronous)
    period = 1 if synchronous else args.period  # a replica group's steps since its last sync die with it
    batch, seq = BATCH[smoke]
    ft = [sys.executable, str(REPO / "train.py"), "fault_tolerance=torchft", f"launcher.nproc={groups}", *base]
    ft.append(f"fault_tolerance.max_restarts={args.failures + 1}")  # one group may take every failure
    ft += args.ft
    baseline = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(groups),
        "--max-restarts",
        str(args.failures + 2),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        str(REPO / "train.py"),
        *base,
        "checkpoint=sharded",
        f"checkpoint.interval={args.checkpoint_interval}",
    ]
    jobs = [
        ("torchft, no failures", ft, None),
        ("torchft, failures", ft, args.every),
        ("restart from checkpoints, failures", baseline, args.every),
    ]
    lines = []
    # one round per seed, its three jobs back to back: this machine's speed drifts by up to 15 % over minutes,
    # which a round's ratios mostly cancel and medians over rounds do not follow
    for seed in args.seeds:
        for name, cmd, every in jobs:
            run_dir = work / f"{groups}-{len(lines)}"
            job = run_job(
                [*cmd, f"train.seed={seed}", f"hydra.run.dir={run_dir}"],
                run_dir,
                every,
                args.failures,
                "torchft" in name,
                work,
                steps,
                args.wandb,
            )
            figures = summarize(name, job, batch * seq, groups, period, run_dir)
            lines.append({"groups": groups, "seed": seed, **figures})
            print(json.dumps(lines[-1]), flush=True)
    return lines


def round_figures(clean: dict, faulty: dict, restart: dict) -> dict:
    """One round's ratios, and each failure's cost: the seconds it adds to the time the failure-free job
    takes for its tokens (f for the fault-tolerant job, c for the baseline). With a failure every T seconds
    of a job's wall time, its goodput is 1 - f / T (or 1 - c / T) of the failure-free job's, so the targets
    hold together only while 10 f <= T (0.9x) and T <= 2 c - f (2x): only when c >= 5.5 f."""
    f, c = (
        clean["wall_s"] * (clean["useful_tokens_per_s"] / job["useful_tokens_per_s"] - 1) / job["failures"]
        if job["failures"]
        else float("nan")
        for job in (faulty, restart)
    )
    return {
        "x_clean": faulty["useful_tokens_per_s"] / clean["useful_tokens_per_s"],
        "x_restart": faulty["useful_tokens_per_s"] / restart["useful_tokens_per_s"],
        "f": f,
        "c": c,
    }


def report(lines: list[dict], every: float, cap: int) -> None:
    print(
        "\n| groups | seed | job | wall s | useful tokens/s | failures | steps redone | steps skipped "
        "| heal s (median) | heal host MiB (sender) | slowest step s | median step s | quorum s (median) "
        "| held-out loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        cells = [
            line["groups"],
            line["seed"],
            line["job"],
            f"{line['wall_s']:.1f}",
            f"{line['useful_tokens_per_s']:.0f}",
            line["failures"],
            line["steps_redone"],
            line["steps_skipped"],
            "–" if line["heal_s_median"] is None else f"{line['heal_s_median']:.2f}",
            "–" if line["heal_sent_mib"] is None else f"{line['heal_sent_mib']:.2f}",
            "–" if line["slowest_step_s"] is None else f"{line['slowest_step_s']:.2f}",
            "–" if line["median_step_s"] is None else f"{line['median_step_s']:.3f}",
            "–" if line["quorum_s_median"] is None else f"{line['quorum_s_median']:.4f}",
            "–" if line["eval_loss"] is None else f"{line['eval_loss']:.4f}",
        ]
        print("| " + " | ".join(map(str, cells)) + " |")
    for groups in sorted({line["groups"] for line in lines}):
        mine = [line for line in lines if line["groups"] == groups]
        rounds = []
        print()
        for i in range(0, len(mine), 3):
            rounds.append(round_figures(*mine[i : i + 3]))
            figures = rounds[-1]
            print(
                f"{groups} groups, seed {mine[i]['seed']}: {figures['x_clean']:.2f}x the failure-free goodput, "
                f"{figures['x_restart']:.2f}x the baseline's; a failure costs the fault-tolerant job "
                f"{figures['f']:.2f} s and the baseline {figures['c']:.2f} s"
            )
        median = {key: statistics.median(figures[key] for figures in rounds) for key in rounds[0]}
        failures = {
            job: [line["failures"] for line in mine if line["job"] == job]
            for job in ("torchft, failures", "restart from checkpoints, failures")
        }
        print(
            f"{groups} groups, median of {len(rounds)}: fault-tolerant goodput {median['x_clean']:.3f}x the "
            f"failure-free run (target >= 0.9), {median['x_restart']:.3f}x the restart-from-checkpoints baseline "
            f"(target >= 2), a failure every {every:g} s ("
            + " and ".join(f"{min(n)}-{max(n)} failures a {job.split(',')[0]} job" for job, n in failures.items())
            + f"); a failure costs the fault-tolerant job {median['f']:.2f} s and the baseline {median['c']:.2f} s, "
            f"so both targets hold for a failure every {10 * median['f']:.1f} to {2 * median['c'] - median['f']:.1f} s"
        )
        quorum = [
            line["quorum_s_median"] / line["median_step_s"]
            for line in mine
            if line["job"] == "torchft, no failures" and line["quorum_s_median"] is not None
        ]
        if quorum:  # a quorum every step (synchronous), or at each sync
            print(
                f"{groups} groups: the quorum's median time over the median step without failures, "
                + ", ".join(f"{q:.3f}" for q in quorum)
                + f" (median {statistics.median(quorum):.3f}; target <= 0.02 with a quorum every step)"
            )
        capped = [job.split(",")[0] for job, n in failures.items() if max(n) >= cap]
        if capped:
            print(
                f"{groups} groups: {' and '.join(capped)} reached --failures {cap} and ran on without failures, "
                "so its goodput is overstated (for the baseline alone: the ratio to it is a lower bound)"
            )
        clean = [line["eval_loss"] for line in mine if line["job"] == "torchft, no failures"]
        faulty = [line["eval_loss"] for line in mine if line["job"] == "torchft, failures"]
        if len(clean) > 1 and None not in clean + faulty:
            low, high = min(clean), max(clean)
            where = ["below" if loss < low else "inside" if loss <= high else "above" for loss in faulty]
            print(
                f"{groups} groups: held-out loss with failures "
                + ", ".join(f"{loss:.4f} ({w})" for loss, w in zip(faulty, where))
                + f" against the failure-free runs' spread over {len(clean)} seeds, {low:.4f} to {high:.4f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="2 groups, one failure, a few steps (tests/test_bench.py)")
    parser.add_argument(
        "--groups", type=integers(2), default=[2, 4], help="replica groups (one CPU rank each), comma-separated"
    )
    parser.add_argument("--steps", type=at_least(1), default=1500)
    parser.add_argument(
        "--averager",
        choices=("diloco", "none"),
        default="diloco",
        help="what every job trains: DiLoCo, or synchronous training (averager=none: a quorum every step)",
    )
    parser.add_argument("--period", type=at_least(1), default=8, help="DiLoCo's averager.period")
    parser.add_argument("--every", type=above(0), default=10.0, help="seconds between failures")
    parser.add_argument(
        "--failures",
        type=at_least(1),
        default=40,
        help="at most this many failures a job (a bound on a stalled job's time)",
    )
    parser.add_argument("--checkpoint-interval", type=at_least(1), default=8, help="the baseline's checkpoint.interval")
    parser.add_argument("--seed", type=at_least(0), default=0, help="which group or rank each failure hits")
    parser.add_argument(
        "--seeds",
        type=integers(0),
        default=[0, 1, 2],
        help="one round of the three jobs per train.seed; medians over the rounds, and the held-out loss's spread",
    )
    parser.add_argument("--keep", help="a directory to keep each job's run dir in (logs, metrics), <groups>-<job>")
    parser.add_argument(
        "--wandb",
        choices=("offline", "disabled"),
        default="offline",
        help="every job's W&B mode: offline is the harness's default, and a restarted group opens its W&B run too",
    )
    parser.add_argument(
        "--ft",
        nargs="*",
        default=[],
        help="more overrides for the fault-tolerant jobs (fault_tolerance.heartbeat_timeout_s=2)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.steps, args.period, args.every, args.failures, args.seeds = [2], 80, 4, 1.0, 1, [0]
    random.seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as scratch:
        work = Path(args.keep or scratch)
        work.mkdir(parents=True, exist_ok=True)
        lines = []
        for groups in args.groups:
            lines += measure(groups, args, work)
    report(lines, args.every, args.failures)
    print("bench/faults.py: done")


if __name__ == "__main__":
    main()
