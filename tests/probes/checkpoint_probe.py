"""torchrun entry for tests: build a job from overrides, load a checkpoint into
it with the harness's own `Trainer` (which resumes as it starts), and write what the model then holds.

Usage: torchrun --nproc-per-node N tests/probes/checkpoint_probe.py CKPT OUT.pt [hydra overrides...]
Writes OUT.pt (rank 0): {"model": FQN -> full tensor, "parts": the stateful
parts' tensors, whole, "step": int, "samples": int}.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint.state_dict import get_model_state_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.checkpoint import gather_full  # noqa: E402
from harness.checkpoint.checkpointer import tensor_state  # noqa: E402
from harness.config import register_configs  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.job import build_job  # noqa: E402
from harness.loop import Trainer  # noqa: E402
from harness.plan import plan_run  # noqa: E402


def main(ckpt: str, out: str, overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["wandb.mode=disabled", *overrides])
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    job = build_job(cfg, env, plan_run(cfg, env.world_size, env.local_world_size, Path(out).parent))
    with Trainer(job, cfg, env, Path(out).parent, resume_from=Path(ckpt)) as trainer:
        step = trainer.clock.step
    model = gather_full(get_model_state_dict(job.model), keep=env.is_main)
    parts = {name: gather_full(tensor_state(part), keep=env.is_main) for name, part in job.checkpoint_parts().items()}
    if env.is_main:
        torch.save({"model": model, "parts": parts, "step": step, "samples": job.data.samples}, out)
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    # Leave without interpreter finalization: process groups still referenced by
    # torch's DeviceMesh cache are destroyed there, and a gloo worker thread then
    # aborts the process now and then ("terminate called without an active
    # exception", SIGABRT; pytorch/pytorch#179291). The output is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
