"""Shims for the torch versions harness supports (2.11 to 2.15).

Each shim names the versions it exists for, so it can go when they are dropped.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.staging import DefaultStager

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# torch 2.11 and 2.12: `DefaultStager._stage` closes its StateDictStager after
# every stage (pytorch/pytorch PR #170431). That close() empties the deep-copy
# dispatch table and the cache of staging buffers, so a stager passed to a
# second `dcp.async_save` fails with `KeyError: <class 'type'>`
# (pytorch/pytorch#183413; fixed in 2.13 by PR #183424).
STAGE_CLOSES_STAGER = TORCH_VERSION < (2, 13)


class ReusableStager(DefaultStager):
    """DCP's DefaultStager, reusable across saves on every supported torch.

    Where `_stage` closes the inner stager, that close() is shadowed for the
    duration of the stage, so the dispatch table and the staging buffers
    (pinned on CUDA) survive to the next save, as they do from torch 2.13 on.
    `close()` still releases them at the end of the run.
    """

    def _stage(self, state_dict, **kwargs):
        if not STAGE_CLOSES_STAGER:
            return super()._stage(state_dict, **kwargs)
        inner = self._state_dict_stager
        inner.close = lambda: None
        try:
            return super()._stage(state_dict, **kwargs)
        finally:
            del inner.close
