"""Local rank launches that never finish: torch's elastic agent against the harness's launcher.

    python bench/launch_hangs.py [--seconds 180] [--nproc 4]
    python bench/launch_hangs.py --smoke   # --seconds 1 --nproc 2: a launch or two per mode

Each launch forks `--nproc` ranks that join a gloo group through env:// (one
TCPStore connect each), all-reduce one number and leave. `agent` launches them
with `elastic_launch` (fork, c10d rendezvous), as the harness used to;
`harness` with `harness.launch.run_local_ranks`. A launch that fails is a hang:
some rank never connected, and its peers gave up after `--init-timeout-s`
(gdb on such a rank shows it waiting forever on glibc's resolver lock under
c10d's reverse lookup of the store's address, a lock it inherited, held, from
the launcher's store-server thread at fork time). Each mode runs for
`--seconds`, one after the other, in this process. Prints per mode: launches,
hangs, hangs per 100 launches, the median launch time.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import statistics
import sys
import time
import uuid

import torch
import torch.distributed as dist
from flags import above, at_least
from harness_runs import SMOKE_HELP
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from harness.launch import run_local_ranks

SMOKE = ["--seconds", "1", "--nproc", "2"]


def join_and_leave(timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def launch_with_agent(nproc: int, timeout_s: float) -> bool:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="fork",
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, join_and_leave)(timeout_s)
        return True
    except ChildFailedError:
        return False


def launch_with_harness(nproc: int, timeout_s: float) -> bool:
    return not run_local_ranks(join_and_leave, (timeout_s,), nproc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=above(0), default=180, help="time per mode")
    parser.add_argument("--nproc", type=at_least(1), default=4)
    parser.add_argument("--init-timeout-s", type=above(0), default=15)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {' '.join(SMOKE)}")
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])
    logging.disable(logging.ERROR)  # a hang's tracebacks from torch's launchers: counted, not printed
    print(f"{'mode':8} {'launches':>9} {'hangs':>6} {'per 100':>8} {'median s':>9}")
    for mode, launch in (("agent", launch_with_agent), ("harness", launch_with_harness)):
        times, hangs, end = [], 0, time.time() + args.seconds
        while time.time() < end:
            start = time.perf_counter()
            if launch(args.nproc, args.init_timeout_s):
                times.append(time.perf_counter() - start)
            else:
                hangs += 1
        launches = len(times) + hangs
        median = statistics.median(times) if times else float("nan")  # nan: every launch hung
        print(
            f"{mode:8} {launches:9d} {hangs:6d} {100 * hangs / launches:8.2f} {median:9.2f}",
            flush=True,
        )
    print("bench/launch_hangs.py: done")


if __name__ == "__main__":
    main()
