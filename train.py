"""Entry point: `python train.py [overrides]` or `torchrun --nproc-per-node N train.py [overrides]`."""

import sys

import hydra

from harness.config import register_configs
from harness.launch import exit_now, prepare_torchrun_rank, refuse_unwritable_run_dir, start

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> None:
    start(cfg)


if __name__ == "__main__":
    refuse_unwritable_run_dir(sys.argv)
    prepare_torchrun_rank(sys.argv)
    try:
        main()
    except SystemExit as e:  # Hydra's and the harness's failures
        exit_now(e.code)
    exit_now(0)
