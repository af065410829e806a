"""Checks of the command line that run before Hydra composes the config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.dist import agree_on_run_stamp, join_rendezvous, print_once, under_torchrun
from harness.launch.exit import exit_now


def is_multirun(argv: list[str]) -> bool:
    return any(arg in ("-m", "--multirun") for arg in argv[1:])


def prepare_torchrun_rank(argv: list[str]) -> None:
    """Before Hydra composes: agree on one run dir.

    A sweep under torchrun is refused: every rank would run the sweep, and a
    rank that fails one job moves on while its peers' collectives pair up with
    the previous job - silent corruption. `python train.py -m` starts a fresh
    group of ranks per job instead.
    """
    if under_torchrun():
        join_rendezvous()
        if is_multirun(argv):
            print_once(
                "harness: `torchrun ... train.py -m` would run the whole sweep on every rank, and one failed "
                "job would silently pair later collectives with the wrong job. Fix: run sweeps without "
                f"torchrun, e.g. `python train.py -m ... launcher.nproc={os.environ['WORLD_SIZE']}`: each job "
                "then starts its own ranks.",
                int(os.environ["RANK"]),
            )
            exit_now(2)
        agree_on_run_stamp()


def refuse_unwritable_run_dir(argv: list[str]) -> None:
    """Hydra creates the run dir before any harness code runs and fails with a
    traceback when it cannot; say it in one line instead."""
    given = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("hydra.run.dir=")]
    if is_multirun(argv) or (given and "${" in given[-1]):
        return
    path = Path(given[-1] if given else "outputs").expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        print(
            f"harness: the run dir {str(path)!r} cannot be created: {existing} is not a writable directory. "
            "Fix: hydra.run.dir=<a folder you can write to>.",
            file=sys.stderr,
        )
        sys.exit(2)
