"""torchrun entry for tests: train.py as `__main__`, but this replica group's rank SIGKILLs
itself right after the quorum that opens step HARNESS_TEST_DIE_AT_STEP, so the exchange its
peers start at that step is certain to fail (an outside SIGKILL cannot aim inside one step).

torchft's own integration tests inject failures the same way, inside the training loop.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # as `python train.py` would

from harness.fault_tolerance.replica_group import ReplicaGroup  # noqa: E402

DIE_AT_STEP = int(os.environ["HARNESS_TEST_DIE_AT_STEP"])
before_step = ReplicaGroup.before_step


def before_step_then_die(self) -> None:
    before_step(self)
    if self.trainer.state.step + 1 == DIE_AT_STEP:
        os.kill(os.getpid(), signal.SIGKILL)


ReplicaGroup.before_step = before_step_then_die
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
