"""torchrun entry for tests: train.py as `__main__`, but this replica group's rank SIGKILLs
itself at step HARNESS_TEST_DIE_AT_STEP, so the exchange its peers start at that step is
certain to fail (an outside SIGKILL cannot aim inside one step): right after the quorum that
opens the step, or with HARNESS_TEST_DIE_IN=all_reduce inside its first gradient all-reduce
across the groups, once this rank has started it (its peers may have some of its data).

torchft's own integration tests inject failures the same way, inside the training loop.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # as `python train.py` would

from harness.fault_tolerance.link import TorchftLink  # noqa: E402
from harness.fault_tolerance.replica_group import ReplicaGroup  # noqa: E402

DIE_AT_STEP = int(os.environ["HARNESS_TEST_DIE_AT_STEP"])
IN_ALL_REDUCE = os.environ.get("HARNESS_TEST_DIE_IN") == "all_reduce"
before_step, all_reduce = ReplicaGroup.before_step, TorchftLink.all_reduce
dying = False


def before_step_then_die(self, tick):
    global dying
    tick = before_step(self, tick)
    if tick.step == DIE_AT_STEP:
        if not IN_ALL_REDUCE:
            os.kill(os.getpid(), signal.SIGKILL)
        dying = True
    return tick


def all_reduce_then_die(self, tensor):
    work = all_reduce(self, tensor)
    if dying:
        os.kill(os.getpid(), signal.SIGKILL)
    return work


ReplicaGroup.before_step = before_step_then_die
TorchftLink.all_reduce = all_reduce_then_die
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
