"""How ranks come to exist: torchrun starts them, or `python train.py` starts
`launcher.nproc` of them itself; a sweep job does the latter and keeps its
failure to itself. One module per job: `argv` (the command line, before Hydra
composes), `check` (the config against its world: validate, preflight, plan),
`entry` (train.py's Hydra entry), `ranks` (starting local ranks, their
failures), `replica_groups` (fault_tolerance=torchft: a lighthouse and a
supervisor per replica group), `logs`, `exit`."""

from harness.launch.argv import is_multirun, prepare_torchrun_rank, refuse_unwritable_run_dir
from harness.launch.check import check_config, local_rank_count, start_method
from harness.launch.entry import start
from harness.launch.exit import exit_now, exit_now_when_done
from harness.launch.logs import setup_logging
from harness.launch.ranks import free_port, run_local_ranks, start_local_ranks

__all__ = [
    "check_config",
    "exit_now",
    "exit_now_when_done",
    "free_port",
    "is_multirun",
    "local_rank_count",
    "prepare_torchrun_rank",
    "refuse_unwritable_run_dir",
    "run_local_ranks",
    "setup_logging",
    "start",
    "start_local_ranks",
    "start_method",
]
