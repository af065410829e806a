"""A rank stopped as it leaves (tests/test_faults.py): one rank started by the harness's own launcher
(`run_local_ranks`, as `python train.py` starts its ranks) whose body returns, and the finalizer of an
object the body held runs as it does; the SIGTERM its launcher sends lands there (sent by the finalizer
itself, so that it lands there every time). Prints the rank's exit status.

Usage: python tests/probes/stopped_while_leaving.py
"""

import os
import signal
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.launch.ranks import run_local_ranks  # noqa: E402


class Held:
    """Something a rank's body holds whose finalizer runs as the body returns (torch.library's does, at exit)."""


def stopped_in_the_finalizer() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the signal's handler runs here


def body() -> None:
    held = Held()
    weakref.finalize(held, stopped_in_the_finalizer)


if __name__ == "__main__":
    failures = run_local_ranks(body, (), 1)
    print(f"rank exit status: {failures[0].exitcode if failures else 0}", flush=True)
    os._exit(0)
