"""torchrun entry for tests: train with the harness's own `build_job` + `Trainer`
and count, on every rank, the aten ops and host syncs of each step that is not
a log step (`harness.profiling.DispatchCounter`); at one rank, the same for the
plain loop of bench/reference_loops.py, over as many steps.

Usage: torchrun --nproc-per-node N tests/probes/dispatch_probe.py OUT.json [hydra overrides...]
Writes OUT.json (rank 0): {"steps": [step, ...], "ranks": [[{"ops": n, "host_syncs": n}, ...] per step, ...]
per rank, "plain": [{"ops": n, "host_syncs": n}, ...] per step (one rank only)}. `train.log_every` must leave
steps that do not log (steps 2 .. log_every - 1).
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from reference_loops import plain  # noqa: E402

from harness.config import register_configs  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.job import build_job  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.loop import Trainer  # noqa: E402
from harness.plan import plan_run  # noqa: E402
from harness.profiling import DispatchCounter  # noqa: E402


def main(out: str, overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["wandb.mode=disabled", *overrides])
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    run_dir = Path(out).parent
    job = build_job(cfg, env, plan_run(cfg, env.world_size, env.local_world_size, run_dir))
    log_every, counts = cfg.train.log_every, []
    steps = [s for s in range(2, cfg.train.steps) if s % log_every]
    with Trainer(job, cfg, env, run_dir) as trainer:
        for step in range(1, cfg.train.steps + 1):
            if step in steps:
                with DispatchCounter() as counter:
                    trainer.run(until=step)
                counts.append({"ops": counter.total, "host_syncs": counter.host_syncs})
            else:
                trainer.run(until=step)
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, counts)
    result = {"steps": steps, "ranks": ranks}
    if env.world_size == 1:
        _, plain_steps = plain(cfg, env)
        plain_steps(1)
        result["plain"] = []
        for _ in steps:
            with DispatchCounter() as counter:
                plain_steps(1)
            result["plain"].append({"ops": counter.total, "host_syncs": counter.host_syncs})
    if env.is_main:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_now(0)  # the output is written; interpreter finalization can abort in gloo (see exit_now)
