"""How a harness process leaves: `exit_now`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


def exit_on_exception(body, *args) -> None:
    """`body(*args)` as a started rank's process runs it: an exception (a bug) leaves as exit 1 with
    its traceback in the rank's log and its first line as the rank's reason (`record_failure`), not
    through torch's multiprocessing, which would pickle it into a /tmp/pytorch-errorfile-*.pickle
    that no one removes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        body(*args)
    except SignalException as e:  # stopped by whoever started it (the launcher, Ctrl-C): one line, no traceback,
        # and at once: a clean exit joins the threads still working (torchft's quorum, mid-way through a process
        # group's setup that waits dist.timeout_s for the peer that is gone), and its starter waits for it
        logging.getLogger("harness").warning("the rank was stopped (%s)", e.sigval.name)
        exit_now(128 + e.sigval)
    except Exception as e:
        logging.getLogger("harness").exception("the rank failed")
        record_failure(": ".join([type(e).__name__, *str(e).splitlines()[:1]]))
        raise SystemExit(1) from None


def record_failure(reason: str) -> None:
    """Why this rank failed, in one line, where the process that started it
    reads it: torch elastic's error file (`TORCHELASTIC_ERROR_FILE`, set by
    torchrun and by `run_local_ranks`), as `ProcessFailure.message`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": reason[:500], "timestamp": int(time.time())}))
