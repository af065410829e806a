"""How a harness process leaves: `exit_now`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import NoReturn

# the signals torchelastic's start_processes turns into a SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE's default)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


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


def on_stop_signals(handler: Callable[[int, FrameType | None], None] | signal.Handlers) -> None:
    """`handler` for every stop signal from now on (`signal.SIG_IGN`: ignored)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def exit_on_exception(body, *args) -> None:
    """`body(*args)` as a started rank's process runs it: an exception (a bug) leaves as exit 1 with
    its traceback in the rank's log and its first line as the rank's reason (`record_failure`), not
    through torch's multiprocessing, which would pickle it into a /tmp/pytorch-errorfile-*.pickle
    that no one removes; a stop signal as `rank_stopped` says."""
    on_stop_signals(rank_stopped)
    try:
        body(*args)
    except Exception as e:
        logging.getLogger("harness").exception("the rank failed")
        record_failure(": ".join([type(e).__name__, *str(e).splitlines()[:1]]))
        raise SystemExit(1) from None


def rank_stopped(signum: int, frame: FrameType | None) -> NoReturn:
    """A started rank stopped by whoever started it (the launcher, Ctrl-C), whatever it is doing: one line, no
    traceback, and at once (a clean exit joins the threads still working: torchft's quorum, mid-way through a
    process group's setup that waits dist.timeout_s for the peer that is gone; and its starter waits for it).
    Torchelastic's handler, which a forked rank inherits from its launcher, raises a SignalException where the
    signal lands instead: in a finalizer as the rank leaves, or in torch's wait for the launcher to read the
    rank's result, it came out as a traceback, and an `except Exception` on its way could take it for a failure."""
    logging.raiseExceptions = False  # a log handler already closed as the process leaves: no "Logging error"
    logging.getLogger("harness").warning("the rank was stopped (%s)", signal.Signals(signum).name)
    exit_now(128 + signum)


def record_failure(reason: str) -> None:
    """Why this rank failed, in one line, where the process that started it
    reads it: torch elastic's error file (`TORCHELASTIC_ERROR_FILE`, set by
    torchrun and by `run_local_ranks`), as `ProcessFailure.message`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": reason[:500], "timestamp": int(time.time())}))
