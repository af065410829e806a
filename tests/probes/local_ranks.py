"""`torchrun --nproc-per-node N script args...` for the probes, through the harness's own
launcher (`run_local_ranks`, as `python train.py` starts its ranks): the ranks are forked from
this process, which has imported what they import (the tests' zygote forks it with them
already), instead of N fresh interpreters each importing torch again (about 4 s of CPU a rank,
on 2 cores). The tests of torchrun itself still run torchrun.

Usage: python tests/probes/local_ranks.py N SCRIPT [args...]
"""

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.launch.ranks import failure_summary, run_local_ranks  # noqa: E402


def run_script(script: str, args: list[str]) -> None:
    """The probe as `__main__`. A probe leaves through `os._exit` (under torchrun, so that
    interpreter finalization cannot abort in gloo); a forked rank must return instead, or the
    launcher waits forever for its result, so here that exit raises and a clean one returns."""
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    os_exit = os._exit

    def leave(code: int) -> None:
        raise SystemExit(code)

    os._exit = leave
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    finally:
        os._exit = os_exit


if __name__ == "__main__":
    nproc, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    failures = run_local_ranks(run_script, (script, args), nproc, "fork")
    if failures:
        print(f"local_ranks.py: {failure_summary(failures)}", file=sys.stderr)
        sys.exit(1)
