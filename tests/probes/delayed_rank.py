"""torchrun entry for tests: rank 1 starts 2.5 s late, then runs train.py as `__main__`.

Ranks that start in different seconds would compose different `${now:...}` run
dirs unless the harness makes them agree.
"""

import os
import runpy
import sys
import time
from pathlib import Path

if os.environ.get("RANK") == "1":
    time.sleep(2.5)
train = Path(__file__).resolve().parents[2] / "train.py"
sys.argv[0] = str(train)
sys.path.insert(0, str(train.parent))  # as `python train.py` would
runpy.run_path(str(train), run_name="__main__")
