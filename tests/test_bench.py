"""Every bench still runs: `python bench/<name>.py --smoke` (the smallest run through
all of the bench's paths, on CPU) exits 0 and prints its table, which
ends with the line `bench/<name>.py: done`. A bench is any script in bench/ with a
`__main__` block, so a new one is covered without touching this file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from support import REPO, base_env, run_cli

BENCHES = sorted(p.name for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
# the limit catches a hang, not slowness: smoke runs took 13-248 s at load 3 on the 2 cores (quality.py
# the longest, then averaging.py 112 s; 2026-11-25), and another suite plus 4-rank jobs on the same
# cores made the whole suite 6x slower (a 180 s limit failed three), so it is stretched by the load
# average per core when the run starts
SMOKE_LIMIT_S = 400
SMOKE_LIMIT_MAX_S = 1800


def smoke_limit_s(load_per_core: float) -> float:
    """The limit of one smoke run, given the machine's 1-minute load average per core."""
    return min(SMOKE_LIMIT_S * max(1.0, load_per_core), SMOKE_LIMIT_MAX_S)


def test_every_bench_is_found():
    assert {"gpu.py", "overhead.py", "checkpoint.py"} <= set(BENCHES)


def test_the_smoke_limit_grows_with_the_load():
    assert smoke_limit_s(0.2) == SMOKE_LIMIT_S
    assert smoke_limit_s(4.0) == 4 * SMOKE_LIMIT_S  # load 8 on 2 cores
    assert smoke_limit_s(50.0) == SMOKE_LIMIT_MAX_S


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_LIMIT_MAX_S + 60)  # the run's own limit below comes first
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke(script, tmp_path):
    limit = smoke_limit_s(os.getloadavg()[0] / (os.cpu_count() or 1))
    proc = subprocess.Popen(
        [sys.executable, f"bench/{script}", "--smoke"],
        cwd=REPO,
        env=base_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its ranks too are stopped at the limit, so no pipe stays open
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"bench/{script} --smoke ran past {limit:.0f} s\nSTDOUT:\n{stdout[-4000:]}\nSTDERR:\n{stderr[-4000:]}"
        )
    output = f"STDOUT:\n{stdout[-4000:]}\nSTDERR:\n{stderr[-4000:]}"
    assert proc.returncode == 0, f"bench/{script} --smoke exited {proc.returncode}\n{output}"
    assert stdout.rstrip().endswith(f"bench/{script}: done"), f"no table, or not to its end\n{output}"


# (bench, its arguments, what its message says): the flag the user passed, and the fix; refused by argparse
# (exit 2) before anything runs, a bench's numbers by the types of bench/flags.py
BAD_ARGUMENTS = [
    ("gpu.py", ["--models", "gpt2"], ["--models gpt2: gpt2 is not one of this device's models", "Fix: --models gpt,"]),
    ("gpu.py", ["--count-steps", "0"], ["argument --count-steps: must be an integer >= 1, got '0'"]),
    ("gpu.py", ["--float8", "fast"], ["argument --float8: invalid choice: 'fast'"]),
    ("gpu.py", ["--kernels", "bogus"], ["--kernels bogus: no path bogus (paths: harness,"]),  # it exited 1
    ("gpu.py", ["--compile-backend", "bogus"], ["argument --compile-backend: invalid choice: 'bogus'"]),  # unchecked
    (  # measured the float8 rows, then "not run here", exit 0
        "gpu.py",
        ["--float8", "speed"],
        ["--float8 speed: train.float8=tensorwise: the ranks run on the CPU, where float8 cannot pay"],
    ),
    (
        "overhead.py",
        ["--nproc", "0"],
        ["argument --nproc: must be an integer >= 1, got '0'"],
    ),  # it named launcher.nproc
    ("overhead.py", ["--rounds", "1"], ["argument --rounds: must be an integer >= 2, got '1'"]),
    ("matrix.py", ["--rows", "torchf"], ["--rows torchf: choose from one-world,torchft"]),
    ("matrix.py", ["--only", "nosuchrow"], ["--only nosuchrow: no trained row's name holds it"]),  # "done", exit 0
    ("matrix.py", ["--smoke", "--only", "nosuchrow"], ["--only nosuchrow: no trained row's name holds it"]),
    ("uneven.py", ["--rounds", "0"], ["argument --rounds: must be an integer >= 1, got '0'"]),  # StatisticsError
    ("uneven.py", ["--steps", "0"], ["argument --steps: must be an integer >= 1, got '0'"]),  # checkpoint.interval=0
    ("uneven.py", ["--factor", "nan"], ["argument --factor: must be a finite number > 1, got 'nan'"]),
    ("uneven.py", ["--steps", "4", "--warmup", "4"], ["--steps 4 must be above --warmup 4"]),
    ("uneven.py", ["--part", "hierarchy", "--period", "1"], ["--period 1: part hierarchy averages pairs"]),
    ("uneven.py", ["--plot", "/nonexistent/u.png"], ["argument --plot: must be a file name in an existing directory"]),
    ("averaging.py", ["--periods", "4,x"], ["argument --periods: must be comma-separated integers, each >= 1"]),
    ("averaging.py", ["--rates", "fast"], ["argument --rates: rate 'fast': use tc's bit rates"]),
    ("averaging.py", ["--fragments", "3"], ["--fragments 3 must divide --overlap-period 32"]),
    ("quality.py", ["--eval-batches", "0"], ["argument --eval-batches: must be an integer >= 1, got '0'"]),
    ("activation_checkpointing.py", ["--batch-size", "-1"], ["argument --batch-size: must be an integer >= 1"]),
    ("checkpoint.py", ["--ranks", "2,0"], ["argument --ranks: must be comma-separated integers, each >= 1"]),
    ("checkpoint.py", ["--dir", "/nonexistent"], ["argument --dir: must be an existing directory"]),
    ("data.py", ["--big-gb", "inf"], ["argument --big-gb: must be a finite number > 0, got 'inf'"]),
    ("exits.py", ["--load", "-1"], ["argument --load: must be an integer >= 0, got '-1'"]),
    ("faults.py", ["--groups", "1"], ["argument --groups: must be comma-separated integers, each >= 2, got '1'"]),
    ("grad_accum.py", ["--accum", "0"], ["argument --accum: must be an integer >= 1, got '0'"]),
    ("in_backward.py", ["--steps", "2", "--skip", "2"], ["--steps 2 must be above --skip 2"]),
    ("launch_hangs.py", ["--seconds", "0"], ["argument --seconds: must be a finite number > 0, got '0'"]),
    ("models.py", ["--steps", "x"], ["argument --steps: must be an integer >= 1, got 'x'"]),
    ("period.py", ["--seeds", "0"], ["argument --seeds: must be an integer >= 1, got '0'"]),
    ("period.py", ["--periods", "4,0"], ["argument --periods: must be comma-separated integers, each >= 1"]),
    ("period.py", ["--steps", "10"], ["--steps 10 must be above --warmup 10"]),
    ("period.py", ["--part", "wan"], ["--part wan: choose from loopback,link"]),
]


@pytest.mark.parametrize("script,args,expected", BAD_ARGUMENTS, ids=[f"{b[0]} {' '.join(b[1])}" for b in BAD_ARGUMENTS])
def test_a_bench_refuses_a_bad_argument_naming_its_flag(script, args, expected, tmp_path):
    if args[:2] == ["--float8", "speed"] and torch.cuda.is_available():
        pytest.skip("refused on the CPU only: a GPU may run it")
    proc = run_cli(args, base_env(tmp_path), REPO, script=REPO / "bench" / script, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and all(text in out for text in expected), out
    assert "Traceback" not in out


def test_every_numeric_bench_flag_is_checked_where_it_is_parsed():
    """A bench's number flag takes a type of bench/flags.py (a range, or argparse's error naming the flag),
    never a bare int or float: `--rounds 0` ended in a StatisticsError after the runs."""
    bare = re.compile(r"type=(int|float)\b|type=lambda [a-z]+: \[(int|float)\(")
    found = [f"{p.name}: {m[0]}" for p in sorted((REPO / "bench").glob("*.py")) for m in bare.finditer(p.read_text())]
    assert found == []


def test_quality_compares_over_seeds_against_their_spread():
    """The smoke runs one seed; bench/quality.py's comparison over several, by its own function."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from quality import Result, compare
    finally:
        sys.path.remove(str(REPO / "bench"))

    def runs(*losses):
        return [Result(eval_loss=x, cross_replica_bytes=1, train_s=1.0, syncs=1) for x in losses]

    close = compare(runs(2.90, 3.00), runs(2.95, 3.01))
    assert "-0.0300" in close and "smaller than the spread between seeds, +-0.0500" in close
    assert "lower on 2 of 2 seeds" in close
    apart = compare(runs(2.50, 2.52), runs(2.95, 3.01))
    assert "larger than the spread" in apart
    assert "one seed" in compare(runs(2.9), runs(3.0))
