"""How a harness process leaves: `exit_now`."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def exit_now_when_done() -> Iterator[None]:
    """A started rank's body: the process then leaves through `exit_now` with the
    body's exit code. A forked rank already does (multiprocessing ends it with
    `os._exit`), but a spawned one (CUDA) ends in `sys.exit` and would finalize.
    It cannot leave inside the body, before the launcher has read its return
    value, so it leaves from an exit handler: the last one registered runs
    first, before any object is torn down."""
    code: int | str | None = 1  # an exception: multiprocessing's exit code for it
    try:
        yield
        code = 0
    except SystemExit as e:
        code = e.code
        raise
    finally:
        atexit.register(exit_now, code)
