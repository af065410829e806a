"""Every bench still runs: `python bench/<name>.py --smoke` (the smallest run through
all of the bench's paths, on CPU) exits 0 and prints its table, which
ends with the line `bench/<name>.py: done`. A bench is any script in bench/ with a
`__main__` block, so a new one is covered without touching this file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from support import REPO, base_env

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


# (bench, its arguments, what its message says): the flag the user passed, and the fix
BAD_ARGUMENTS = [
    ("gpu.py", ["--models", "gpt2"], ["--models gpt2: gpt2 is not one of this device's models", "Fix: --models gpt,"]),
    ("overhead.py", ["--nproc", "0"], ["argument --nproc: must be >= 1, got 0"]),  # it named launcher.nproc
    ("matrix.py", ["--rows", "torchf"], ["--rows torchf: choose from one-world,torchft"]),
]


@pytest.mark.parametrize("script,args,expected", BAD_ARGUMENTS, ids=[f"{b[0]} {' '.join(b[1])}" for b in BAD_ARGUMENTS])
def test_a_bench_refuses_a_bad_argument_naming_its_flag(script, args, expected, tmp_path):
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=REPO, env=base_env(tmp_path), capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and all(text in out for text in expected), out
    assert "Traceback" not in out


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
