"""How a harness process leaves: `exit_now`."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int | str | None) -> NoReturn:
    """Leave without interpreter finalization, with `code` as `sys.exit` reads it.

    At finalization the process groups torch's DeviceMesh cache still holds
    are destroyed, and a gloo worker thread then aborts the process now and
    then (SIGABRT after a complete run: about 1 in 35 torchrun runs on 2 cores;
    pytorch/pytorch#179291), so a finished run or sweep job would count as
    failed. Everything the run writes is closed by now (W&B finished, metrics
    file closed); logging and the standard streams are flushed here.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
