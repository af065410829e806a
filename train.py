"""Entry point: `python train.py [overrides]` or `torchrun --nproc-per-node N train.py [overrides]`."""

import os
import sys
from pathlib import Path

import hydra

from harness.config import register_configs
from harness.dist import print_once
from harness.launch import exit_now, prepare_torchrun_rank, refuse_unwritable_run_dir, start
from harness.overrides import override_errors

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> None:
    start(cfg)


if __name__ == "__main__":
    refuse_unwritable_run_dir(sys.argv)
    prepare_torchrun_rank(sys.argv)
    # Hydra's own composition errors name no fix: bad overrides are refused here, before a run dir exists
    if errors := override_errors(sys.argv, Path(__file__).parent / "conf", "config"):
        print_once("\n\n".join(errors), int(os.environ.get("RANK", 0)))
        exit_now(2)
    try:
        main()
    except SystemExit as e:  # Hydra's and the harness's failures
        exit_now(e.code)
    exit_now(0)
