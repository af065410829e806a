"""Post-local SGD: step time and cross-replica bytes against the averaging period.

What is measured: synchronous training (`averager=none`) and post-local SGD
(`averager=periodic`, one config per `--periods` entry, after `--warmup`
synchronous steps): the time per step and the bytes rank 0 puts into
cross-replica collectives, over the steps after warm-up. Every figure comes
from the harness itself: each run is the real CLI with `train.log_every=1`, and
the bench reads rank 0's `metrics.jsonl` (`train/step_time_s` is then the time
of that one step, `comm/cross_replica_bytes_total` the running byte count,
`averager/time_s` the time of one parameter averaging).

Per run: the median and the mean step time over the post-warm-up window (the
median is the typical step - for a period > 1 a purely local one - while the
mean amortises the averaging steps, so it is the throughput figure), and the
window's cross-replica bytes. Per config: the medians over repeats. The window
is a multiple of every period, so the bytes must fall exactly period-fold from
period 1; the bench checks that as an exact integer ratio.

Part `loopback`: 4 local ranks (`python train.py launcher.nproc=4`), layouts
2 replicas x 2 shards (`sharding=hybrid_shard sharding.replicate=2`) and 4 x 1
(`sharding=no_shard`). The configs run `--repeats` times, in reverse order
every other repeat (A B A ...), to cancel drift.

Part `link`: two "nodes" on this machine - two network namespaces joined by a
veth pair shaped with `tc tbf` on both ends to each `--rates` entry. One
torchrun per namespace (2 ranks each, c10d rendezvous on 10.77.0.1), so the
(replicate, shard) mesh is [[0, 1], [2, 3]]: shards talk inside a node (over
the namespace's loopback, unshaped), replicas talk across the link. Needs root,
`ip netns` and `tc`; without them the part is skipped, saying why. Namespaces
(and with them the veth pair and its qdiscs) are deleted on exit, failure,
Ctrl-C or SIGTERM.

Part `overlap`: Streaming DiLoCo's overlapped syncs (issue 21) on the shaped
link at `--overlap-rate` (over loopback with `--overlap-on loopback`, or where
the link cannot be built): 2 replicas x 2 shards, `averager=diloco` with
`--overlap-period` and `--fragments`, synced at once (`sync_delay=0`) and with
the collectives under `--sync-delay` steps of computation (a run per
`--overlap-comm-dtypes`: float32 and int8 by default), against a run with no
cross-replica communication at all (DiLoCo whose period is longer than the run).
Reported: mean s/step over the window (the throughput figure, syncs amortised)
and its ratio to the no-communication run (target <= 1.1x with a delay).

The train.py / torchrun command is printed once per part, and every ip/tc
command as it runs, so any figure can be reproduced by hand.

    python bench/averaging.py [--part loopback|link|overlap|all] [--steps 20] [--warmup 4]
                              [--periods 1,4,16] [--repeats 3] [--link-repeats 1]
                              [--rates 1gbit,100mbit] [--layouts hybrid,no_shard]
                              [--overlap-rate 100mbit] [--overlap-period 32] [--fragments 4] [--sync-delay 6]
                              [--overlap-comm-dtypes float32,int8]
                              [--overlap-steps 68] [--overlap-on link|loopback]
    python bench/averaging.py --smoke   # parts loopback and overlap on plain loopback, tiny, a few steps

`--smoke` runs parts `loopback` and `overlap` on plain loopback: the shaped link
is what the other runs measure, and each of its runs costs two torchruns in
namespaces, too slow for a smoke run (that part's namespaces and shaping do
work on the 2-core machine as root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

from flags import at_least, integers

REPO = Path(__file__).resolve().parents[1]
MODEL = [
    "model=mlp",
    "model.d_model=512",
    "model.hidden=2048",
    "model.n_layer=4",
    "train.batch_size=2",
    "train.seq_len=32",
]
LAYOUTS = {"2x2 hybrid": ["sharding=hybrid_shard", "sharding.replicate=2"], "4x1 no_shard": ["sharding=no_shard"]}
SMOKE_HELP = "the smallest run through every path of this bench, on CPU, in seconds (tests/test_bench.py)"
SMOKE = (
    "--part smoke --layouts hybrid --periods 1 --steps 3 --warmup 2 --repeats 1 "
    "--overlap-on loopback --overlap-period 8 --fragments 2 --sync-delay 2 --overlap-steps 10 "
    "--overlap-comm-dtypes float32 "
    "--model model.d_model=32,model.hidden=64,model.n_layer=2"
).split()
LINK_LAYOUT = "2x2 hybrid"
RUN_TIMEOUT_S = 600  # one training run, both nodes together
CMD_TIMEOUT_S = 30  # one ip / tc command
KILL_GRACE_S = 15
SUBNET = "10.77.0"  # used only inside the namespaces this bench creates
RDZV_PORT = 29400  # + run number, so no run meets the previous one's TIME_WAIT sockets
TBF_LATENCY = "50ms"
TBF_BURST_S = 0.01  # burst = 10 ms at the rate
OVERLAP_TARGET = 1.1  # issue 21: DiLoCo with fragments and a sync delay, against no communication


@dataclass(frozen=True)
class Averager:
    label: str
    overrides: tuple[str, ...]
    period: int | None  # None: synchronous


@dataclass(frozen=True)
class RunResult:
    median_s: float
    mean_s: float
    window_bytes: int
    n_averaged: int
    averaging_s: float | None  # median time of one averaging; None when none happened
    wall_s: float
    link_bytes: int | None = None  # what the shaped link carried, both directions, whole run (part 2)


@dataclass
class Row:
    """One config's repeats, summarised by medians."""

    averager: Averager
    runs: list[RunResult] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(r.median_s for r in self.runs)

    @property
    def mean_s(self) -> float:
        return statistics.median(r.mean_s for r in self.runs)

    @property
    def window_bytes(self) -> set[int]:
        return {r.window_bytes for r in self.runs}

    @property
    def n_averaged(self) -> set[int]:
        return {r.n_averaged for r in self.runs}

    @property
    def averaging_s(self) -> float | None:
        times = [r.averaging_s for r in self.runs if r.averaging_s is not None]
        return statistics.median(times) if times else None


class RunFailed(RuntimeError):
    pass


# ------------------------------------------------------------------ configs and metrics


def averagers(periods: list[int], warmup: int) -> list[Averager]:
    periodic = [
        Averager(f"period {p}", ("averager=periodic", f"averager.period={p}", f"averager.warmup_steps={warmup}"), p)
        for p in periods
    ]
    # The same synchronous training through the post-local SGD path (replicas sharded on `shard`,
    # gradients averaged by the warm-up hook for the whole run), against native HSDP's `sync`.
    hook_sync = Averager("sync, hook", ("averager=periodic", f"averager.warmup_steps={10**6}"), None)
    return [Averager("sync", ("averager=none",), None), hook_sync, *periodic]


def train_overrides(steps: int, run_dir: Path, model: list[str]) -> list[str]:
    return [
        *MODEL,
        *model,
        f"train.steps={steps}",
        "train.log_every=1",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    ]


def summarize(run_dir: Path, warmup: int, steps: int, wall_s: float) -> RunResult:
    """Rank 0's rows for steps warmup+1 .. steps (log_every=1 gives one row per step)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise RunFailed(f"no {path}")
    rows = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
    if sorted(rows) != list(range(1, steps + 1)):
        raise RunFailed(f"{path}: expected one row per step 1..{steps}, got steps {sorted(rows)}")
    window = [rows[s] for s in range(warmup + 1, steps + 1)]
    times = [r["train/step_time_s"] for r in window]
    averaged = [r["averager/time_s"] for r in window if r.get("averager/averaged")]
    total = "comm/cross_replica_bytes_total"
    return RunResult(
        median_s=statistics.median(times),
        mean_s=statistics.fmean(times),
        window_bytes=rows[steps][total] - rows[warmup][total],
        n_averaged=len(averaged),
        averaging_s=statistics.median(averaged) if averaged else None,
        wall_s=wall_s,
    )


# ------------------------------------------------------------------ processes


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """Start `cmd` in the repo root, in a process group of its own, output to `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (the launcher then stops its ranks); SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=KILL_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Wait for all; on the first failure or the timeout, stop the rest and raise with the logs' tails."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                raise RunFailed(f"timed out after {timeout_s:.0f} s\n{tails(logs)}")
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p)
    if any(p.returncode for p in procs):
        raise RunFailed(f"exit codes {[p.returncode for p in procs]}\n{tails(logs)}")


def tails(logs: list[Path], lines: int = 15) -> str:
    return "\n".join(
        f"--- {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        for log in logs
        if log.exists()
    )


def run_schedule(configs: list[tuple], repeats: int, run_one, workdir: Path) -> dict[tuple, Row]:
    """Run each config `repeats` times, reversing the order every other repeat, printing each result."""
    rows = {c: Row(c[-1]) for c in configs}
    schedule = [c for repeat in range(repeats) for c in (configs if repeat % 2 == 0 else configs[::-1])]
    for n, config in enumerate(schedule, 1):
        result = run_one(config, workdir / f"run{n:03d}", n)
        rows[config].runs.append(result)
        link = "" if result.link_bytes is None else f", link carried {result.link_bytes / 1e6:,.1f} MB"
        print(
            f"  [{n:>2}/{len(schedule)}] {config[0]:<13} {config[1].label:<9} median {result.median_s:.3f} s/step, "
            f"mean {result.mean_s:.3f} s/step, window {result.window_bytes:,} B, "
            f"averaged {result.n_averaged}x, wall {result.wall_s:.0f} s{link}",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------ report

LEGEND = """columns: median / mean s/step over the window, each vs sync; averaging s = median time of one
parameter averaging (averager/time_s); averaged = averaging steps in the window; cross-replica B/step =
rank 0's comm/cross_replica_bytes_total over the window / window steps"""


def print_results(title: str, rows: list[Row], window: int) -> None:
    """Table of one group's configs (sync first), then the period-fold check on bytes."""
    sync = rows[0]
    header = [
        "averager",
        "median s/step",
        "vs sync",
        "mean s/step",
        "vs sync",
        "averaging s",
        "averaged",
        "cross-replica B/step",
    ]
    table = [
        [
            r.averager.label,
            f"{r.median_s:.3f}",
            f"{r.median_s / sync.median_s:.2f}x",
            f"{r.mean_s:.3f}",
            f"{r.mean_s / sync.mean_s:.2f}x",
            "-" if r.averaging_s is None else f"{r.averaging_s:.3f}",
            "/".join(map(str, sorted(r.n_averaged))),
            "/".join(f"{b / window:,.0f}" for b in sorted(r.window_bytes)),
        ]
        for r in rows
    ]
    print(f"\n{title} (medians over {len(sync.runs)} run(s); window = {window} post-warm-up steps)")
    print_table(header, table)
    for line in period_fold_check(rows, window):
        print(line)


def period_fold_check(rows: list[Row], window: int) -> list[str]:
    """Window bytes of period 1 over those of period P must be exactly P (and repeats must agree)."""
    differ = [f"{r.averager.label} {sorted(r.window_bytes)}" for r in rows if len(r.window_bytes) != 1]
    lines = [f"  bytes differ between repeats of one config: {', '.join(differ)}"] if differ else []
    bytes_of = {r.averager.label: min(r.window_bytes) for r in rows}
    base = next((r for r in rows if r.averager.period == 1), None)
    if base is None:
        return lines + ["  period-fold check skipped: needs period 1 in --periods"]
    b1 = bytes_of[base.averager.label]
    same = "=" if bytes_of["sync"] == b1 else "!="
    lines.append(f"  period-fold check, window bytes: sync {bytes_of['sync']:,} ({same} period 1: {b1:,})")
    for r in rows:
        if r.averager.period is None:
            continue
        b, p = bytes_of[r.averager.label], r.averager.period
        ratio = Fraction(b1, b) if b else None
        ok = ratio == p and r.n_averaged == {window // p} and len(r.window_bytes) == len(base.window_bytes) == 1
        lines.append(
            f"    period {p:>2}: {b:>13,} B, period 1 / this = {ratio}, averaged {sorted(r.n_averaged)} of "
            f"{window} steps -> {'exact' if ok else 'NOT EXACT'}"
        )
    return lines


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header, *rows]:
        print("  " + "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))))


def print_load() -> None:
    print("  load average (1/5/15 min): {:.2f} {:.2f} {:.2f} on {} cores".format(*os.getloadavg(), os.cpu_count()))


# ------------------------------------------------------------------ part 1: loopback


def loopback_cmd(layout: str, averager: Averager, steps: int, run_dir: Path, model: list[str]) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "launcher.nproc=4",
        *LAYOUTS[layout],
        *averager.overrides,
        *train_overrides(steps, run_dir, model),
    ]


def part_loopback(args: argparse.Namespace, workdir: Path) -> None:
    configs = [(layout, a) for layout in args.layouts for a in averagers(args.periods, args.warmup)]

    def run_one(config: tuple, run_dir: Path, n: int) -> RunResult:
        run_dir.mkdir(parents=True)
        log, began = run_dir / "launcher.out", time.monotonic()
        wait_all([start(loopback_cmd(*config, args.steps, run_dir, args.model), log)], [log], RUN_TIMEOUT_S)
        return summarize(run_dir, args.warmup, args.steps, time.monotonic() - began)

    print(f"\n== part 1: loopback, 4 local ranks, {args.repeats} repeat(s) x {len(configs)} configs")
    print(
        "command per run (layout and averager overrides vary):\n  "
        + shlex.join(loopback_cmd(*configs[-1], args.steps, workdir / "<run>", args.model))
    )
    print_load()
    rows = run_schedule(configs, args.repeats, run_one, workdir / "loopback")
    print_load()
    for layout in args.layouts:
        print_results(f"loopback, {layout}", [rows[c] for c in configs if c[0] == layout], args.steps - args.warmup)


# ------------------------------------------------------------------ part 2: a shaped link between two namespaces


def sh(*cmd: str, quiet: bool = False, check: bool = True) -> str:
    if not quiet:
        print(f"  $ {shlex.join(cmd)}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and done.returncode:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return done.stdout


class Link:
    """Namespaces <tag>n0 / <tag>n1, veth <tag>v0 (10.77.0.1) <-> <tag>v1 (10.77.0.2), lo up in each.

    A context manager: however its block ends, `close` kills what still runs
    in the namespaces and deletes them (the veth pair and qdiscs go with them),
    including after an `open` that failed half-way.
    """

    def __init__(self) -> None:
        tag = f"hbavg{os.getpid()}"
        self.ns = (f"{tag}n0", f"{tag}n1")
        self.dev = (f"{tag}v0", f"{tag}v1")
        self.addr = (f"{SUBNET}.1", f"{SUBNET}.2")

    def __enter__(self) -> Link:
        return self

    def open(self) -> None:
        sh("ip", "netns", "add", self.ns[0])
        sh("ip", "netns", "add", self.ns[1])
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def __exit__(self, *exc) -> None:
        self.close()

    def shape(self, rate: str) -> None:
        burst = f"{max(64 * 1024, int(rate_bits(rate) / 8 * TBF_BURST_S))}b"
        for ns, dev in zip(self.ns, self.dev):
            sh(
                "tc",
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                TBF_LATENCY,
            )

    def sent_bytes(self) -> int:
        """Bytes both qdiscs have sent (both directions of the link)."""
        return sum(
            q["bytes"]
            for ns, dev in zip(self.ns, self.dev)
            for q in json.loads(sh("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev, quiet=True))
        )

    def close(self) -> None:
        existing = sh("ip", "netns", "list", quiet=True)
        for ns in self.ns:
            if re.search(rf"^{ns}\b", existing, re.M):
                for pid in sh("ip", "netns", "pids", ns, quiet=True, check=False).split():
                    kill_pid(int(pid))
                sh("ip", "netns", "del", ns)
        if sh("ip", "link", "show", self.dev[0], quiet=True, check=False):  # veth made but never moved
            sh("ip", "link", "del", self.dev[0])

    def node_cmd(self, node: int, train_args: list[str], n: int) -> list[str]:
        """One node's torchrun of `train.py train_args` (run `n` of the bench); node 0
        hosts the rendezvous store on its veth address."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns[node],
            "env",
            f"GLOO_SOCKET_IFNAME={self.dev[node]}",
            # torchrun's log tree (its --log-dir) next to the bench's run dirs, not a new /tmp/torchelastic_*
            f"PET_LOG_DIR={next(a for a in train_args if a.startswith('hydra.run.dir=')).split('=', 1)[1]}-torchrun",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.addr[0]}:{RDZV_PORT + n}",
            "--rdzv-id",
            f"bench{n}",
            "--rdzv-conf",
            f"is_host={int(node == 0)},join_timeout=120",
            "--local-addr",
            self.addr[node],
            "train.py",
            *train_args,
        ]


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def rate_bits(rate: str) -> float:
    """tc rate syntax (e.g. 1gbit, 100mbit, 500kbit) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate {rate!r}: use tc's bit rates, e.g. 1gbit, 100mbit, 500kbit")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]


def tc_rate(text: str) -> str:
    """argparse's type for a tc bit rate: the text, once `rate_bits` reads it."""
    rate_bits(text)
    return text


def link_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found" if missing else None


def part_link(args: argparse.Namespace, workdir: Path) -> None:
    print(
        f"\n== part 2: a shaped link, 2 namespaces x 2 ranks ({LINK_LAYOUT}: shards in a node, replicas across "
        f"the link), rates {', '.join(args.rates)}, {args.link_repeats} repeat(s)"
    )
    reason = link_unavailable()
    if reason:
        print(f"  skipped: {reason}; part 2 needs root, `ip netns` and `tc`")
        return
    with Link() as link:  # closes (kills what runs inside, deletes the namespaces) however this block ends
        try:
            link.open()
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"  skipped: cannot build the namespaces ({getattr(e, 'stderr', '') or e})")
            return
        run_link(link, args, workdir)


def run_link(link: Link, args: argparse.Namespace, workdir: Path) -> None:
    configs = [(rate, a) for rate in args.rates for a in averagers(args.periods, args.warmup)]
    shaped = [None]

    def train_args(averager: Averager, run_dir: Path) -> list[str]:
        return [*LAYOUTS[LINK_LAYOUT], *averager.overrides, *train_overrides(args.steps, run_dir, args.model)]

    def run_one(config: tuple, run_dir: Path, n: int) -> RunResult:
        rate, averager = config
        if shaped[0] != rate:
            link.shape(rate)
            shaped[0] = rate
        run_dir.mkdir(parents=True)
        logs = [run_dir / f"node{node}.out" for node in (0, 1)]
        sent, began = link.sent_bytes(), time.monotonic()
        procs = [start(link.node_cmd(node, train_args(averager, run_dir), n), logs[node]) for node in (0, 1)]
        wait_all(procs, logs, RUN_TIMEOUT_S)
        result = summarize(run_dir, args.warmup, args.steps, time.monotonic() - began)
        return replace(result, link_bytes=link.sent_bytes() - sent)

    example = [shlex.join(link.node_cmd(node, train_args(configs[-1][1], workdir / "<run>"), 0)) for node in (0, 1)]
    print(
        "commands per run, both nodes at once (rendezvous port/id and averager overrides vary; "
        "both nodes share hydra.run.dir, where only rank 0 writes metrics.jsonl):\n  " + "\n  ".join(example)
    )
    print_load()
    rows = run_schedule(configs, args.link_repeats, run_one, workdir / "link")
    print_load()
    window = args.steps - args.warmup
    for rate in args.rates:
        print_results(f"link at {rate}, {LINK_LAYOUT}", [rows[c] for c in configs if c[0] == rate], window)


# ------------------------------------------------------------------ part 3: overlapped DiLoCo syncs


def overlap_configs(args: argparse.Namespace) -> list[Averager]:
    diloco = (
        "averager=diloco",
        f"averager.warmup_steps={args.warmup}",
        f"averager.fragments={args.fragments}",
        f"averager.period={args.overlap_period}",
    )
    never = ("averager=diloco", f"averager.warmup_steps={args.warmup}", f"averager.period={10**6}")
    runs = [Averager("no comm", never, None), Averager("delay 0", diloco, args.overlap_period)]
    if args.sync_delay:
        runs += [
            Averager(
                f"delay {args.sync_delay}" + ("" if dtype == "float32" else f", {dtype}"),
                (*diloco, f"averager.sync_delay={args.sync_delay}", f"averager.comm_dtype={dtype}"),
                args.overlap_period,
            )
            for dtype in args.overlap_comm_dtypes
        ]
    return runs


def part_overlap(args: argparse.Namespace, workdir: Path) -> None:
    configs = [("overlap", a) for a in overlap_configs(args)]
    on = args.overlap_on
    if on == "link" and (reason := link_unavailable()):
        print(f"\n== part 3: no shaped link ({reason}): over loopback")
        on = "loopback"
    print(
        f"\n== part 3: DiLoCo syncs overlapped, {LINK_LAYOUT}, "
        + (f"replicas across a {args.overlap_rate} link" if on == "link" else "loopback")
        + f", period {args.overlap_period}, {args.fragments} fragments, {args.link_repeats} repeat(s)"
    )
    steps = args.overlap_steps

    def train_args(averager: Averager, run_dir: Path) -> list[str]:
        return [*LAYOUTS[LINK_LAYOUT], *averager.overrides, *train_overrides(steps, run_dir, args.model)]

    def run_over_loopback(config: tuple, run_dir: Path, n: int) -> RunResult:
        run_dir.mkdir(parents=True)
        log, began = run_dir / "launcher.out", time.monotonic()
        cmd = [sys.executable, "train.py", "launcher.nproc=4", *train_args(config[1], run_dir)]
        wait_all([start(cmd, log)], [log], RUN_TIMEOUT_S)
        return summarize(run_dir, args.warmup, steps, time.monotonic() - began)

    if on == "loopback":
        rows = run_schedule(configs, args.link_repeats, run_over_loopback, workdir / "overlap")
    else:
        with Link() as link:
            link.open()
            link.shape(args.overlap_rate)

            def run_over_link(config: tuple, run_dir: Path, n: int) -> RunResult:
                run_dir.mkdir(parents=True)
                logs = [run_dir / f"node{node}.out" for node in (0, 1)]
                began = time.monotonic()
                procs = [start(link.node_cmd(node, train_args(config[1], run_dir), n), logs[node]) for node in (0, 1)]
                wait_all(procs, logs, RUN_TIMEOUT_S)
                return summarize(run_dir, args.warmup, steps, time.monotonic() - began)

            print_load()
            rows = run_schedule(configs, args.link_repeats, run_over_link, workdir / "overlap")
            print_load()
    quiet = rows[configs[0]]
    window = steps - args.warmup
    table = [
        [
            r.averager.label,
            f"{r.mean_s:.3f}",
            f"{r.mean_s / quiet.mean_s:.2f}x",
            f"{r.median_s:.3f}",
            "-" if r.averaging_s is None else f"{r.averaging_s:.3f}",
            "/".join(map(str, sorted(r.n_averaged))),
            "/".join(f"{b / window:,.0f}" for b in sorted(r.window_bytes)),
        ]
        for r in (rows[c] for c in configs)
    ]
    print(f"\noverlapped syncs (medians over {len(quiet.runs)} run(s); window = {window} post-warm-up steps)")
    header = ["averager", "mean s/step", "vs no comm", "median s/step", "blocked s/sync", "syncs", "B/step"]
    print_table(header, table)
    for delayed in (rows[c] for c in configs[2:]):
        ratio = delayed.mean_s / quiet.mean_s
        verdict = "meets" if ratio <= OVERLAP_TARGET else "misses"
        label = delayed.averager.label
        print(f"  {label}: {ratio:.3f}x the no-communication step time ({verdict} the target <= {OVERLAP_TARGET}x)")


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # smoke: loopback and overlap, both over loopback
    parser.add_argument("--part", choices=("loopback", "link", "overlap", "all", "smoke"), default="all")
    parser.add_argument("--steps", type=at_least(1), default=20, help="steps per run, warm-up included")
    parser.add_argument(
        "--warmup", type=at_least(0), default=4, help="averager.warmup_steps; the window starts after it"
    )
    parser.add_argument("--periods", type=integers(1), default=[1, 4, 16])
    parser.add_argument("--repeats", type=at_least(1), default=3, help="runs per loopback config")
    parser.add_argument("--link-repeats", type=at_least(1), default=1, help="runs per link config")
    parser.add_argument("--rates", type=lambda s: [tc_rate(r) for r in s.split(",")], default=["1gbit", "100mbit"])
    parser.add_argument(
        "--layouts",
        type=lambda s: [layout for name in s.split(",") for layout in LAYOUTS if layout.split()[1] == name],
        default=list(LAYOUTS),
        help="part loopback's layouts, by strategy: hybrid,no_shard",
    )
    parser.add_argument(
        "--model", type=lambda s: s.split(","), default=[], help="overrides of the model's shape, after its defaults"
    )
    parser.add_argument("--overlap-rate", type=tc_rate, default="100mbit", help="part overlap: the link's rate")
    parser.add_argument("--overlap-period", type=at_least(1), default=32, help="part overlap: averager.period")
    parser.add_argument("--fragments", type=at_least(1), default=4, help="part overlap: averager.fragments")
    parser.add_argument("--sync-delay", type=at_least(0), default=6, help="part overlap: the delayed runs' sync_delay")
    parser.add_argument(
        "--overlap-comm-dtypes",
        type=lambda s: s.split(","),
        default=["float32", "int8"],
        help="part overlap: a delayed run per averager.comm_dtype",
    )
    parser.add_argument(
        "--overlap-steps", type=at_least(1), default=68, help="part overlap: steps per run, warm-up included"
    )
    parser.add_argument("--overlap-on", choices=("link", "loopback"), default="link")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *(sys.argv[1:] if argv is None else argv)])
    if not args.layouts:
        parser.error(f"--layouts: choose from {','.join(layout.split()[1] for layout in LAYOUTS)}")
    window, lcm = args.steps - args.warmup, math.lcm(*args.periods)
    if window <= 0 or window % lcm:
        parser.error(
            f"--steps minus --warmup ({window}) must be a positive multiple of every period (lcm {lcm}), "
            f"e.g. --steps {args.warmup + lcm}"
        )
    if args.part not in ("overlap", "all", "smoke"):
        return args
    if args.overlap_steps <= args.warmup:
        parser.error(f"--overlap-steps {args.overlap_steps} must be above --warmup {args.warmup}: no step is timed")
    if args.overlap_period % args.fragments or args.sync_delay >= args.overlap_period // args.fragments:
        parser.error(
            f"--fragments {args.fragments} must divide --overlap-period {args.overlap_period}, and --sync-delay "
            f"{args.sync_delay} must be below their quotient (a sync is applied before the next fragment's starts), "
            "e.g. --overlap-period 32 --fragments 4 --sync-delay 6"
        )
    return args


def raise_on_signal(signum, frame) -> None:
    raise SystemExit(f"bench/averaging.py: got signal {signum}, cleaning up")


def main() -> None:
    args = parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_on_signal)  # so the `with` blocks below still clean up
    model = " ".join([*MODEL, *args.model])
    print(f"model: {model}; {args.steps} steps per run, warm-up {args.warmup}, periods {args.periods}")
    print(LEGEND)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-averaging-") as tmp:
        if args.part in ("loopback", "all", "smoke"):
            part_loopback(args, Path(tmp))
        if args.part in ("link", "all"):
            part_link(args, Path(tmp))
        if args.part in ("overlap", "all", "smoke"):
            part_overlap(args, Path(tmp))
    print(f"\ntotal {time.monotonic() - began:.0f} s")
    print("bench/averaging.py: done")


if __name__ == "__main__":
    main()
