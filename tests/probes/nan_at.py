"""`python train.py` for tests, but one replica's loss turns NaN at one of its local steps:
HARNESS_TEST_NAN_AT="<replica>:<local step>" (0-based, the clock's `Tick.local`), as a bad batch would.
The ranks are forked from this process (CPU), so they run the patched loop.
"""

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # as `python train.py` would

from harness.loop import Trainer  # noqa: E402
from harness.nonfinite import NonFiniteGuard  # noqa: E402

REPLICA, LOCAL_STEP = map(int, os.environ["HARNESS_TEST_NAN_AT"].split(":"))
forward_backward, backward = Trainer._forward_backward, NonFiniteGuard.backward
poisoned = False


def forward_backward_at(self, tick):
    global poisoned
    poisoned = (self.clock.replica, tick.local) == (REPLICA, LOCAL_STEP)
    return forward_backward(self, tick)


def backward_at(self, loss):
    backward(self, loss * float("nan") if poisoned else loss)


Trainer._forward_backward = forward_backward_at
NonFiniteGuard.backward = backward_at
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
