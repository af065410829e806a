"""Every bench still runs: `python bench/<name>.py --smoke` (the smallest run through
all of the bench's paths, on CPU, in seconds) exits 0 and prints its table, which
ends with the line `bench/<name>.py: done`. A bench is any script in bench/ with a
`__main__` block, so a new one is covered without touching this file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import REPO, base_env

BENCHES = sorted(p.name for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
SMOKE_TIMEOUT_S = 180  # a smoke run takes 5-25 s on the 2-core machine; this catches a hang, not slowness


def test_every_bench_is_found():
    assert {"gpu.py", "overhead.py", "checkpoint.py"} <= set(BENCHES)


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", "--smoke"],
        cwd=REPO,
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    output = f"STDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"bench/{script} --smoke exited {proc.returncode}\n{output}"
    assert proc.stdout.rstrip().endswith(f"bench/{script}: done"), f"no table, or not to its end\n{output}"
