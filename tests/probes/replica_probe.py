"""torchrun entry for tests: train with the harness's own `build_job` + `Trainer`,
one step at a time, and record after every step which replicas hold
bit-identical local shards.

Usage: torchrun --nproc-per-node N tests/probes/replica_probe.py OUT.json [hydra overrides...]
Writes OUT.json (rank 0): one record per step, and OUT.pt: the final full parameters.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.config import register_configs  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.job import build_job  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.loop import Trainer  # noqa: E402
from harness.plan import plan_run  # noqa: E402


def local_shards(model) -> torch.Tensor:
    return torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in model.parameters()])


def replica_equality(job) -> list[list[bool]]:
    """[a][b]: replicas a and b hold identical shards, at every shard index."""
    group = job.mesh.get_group("replicate")
    mine = local_shards(job.model)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    same = torch.tensor([[int(torch.equal(a, b)) for b in gathered] for a in gathered])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return same.bool().tolist()


def main(out: str, overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["wandb.mode=disabled", "train.log_every=1", *overrides])
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    run_dir = Path(out).parent  # the trainer's metrics.jsonl (every step: train.log_every=1) lands here
    job = build_job(cfg, env, plan_run(cfg, env.world_size, env.local_world_size, run_dir))
    records = []
    with Trainer(job, cfg, env, run_dir) as trainer:  # checkpoint=none: saves nothing
        for step in range(1, cfg.train.steps + 1):
            trainer.run(until=step)
            records.append(
                {
                    "step": step,
                    "same": replica_equality(job),
                    "local_numel": sum(
                        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in job.model.parameters()
                    ),
                }
            )
    if env.is_main:
        rows = {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
        records = [{**rows[r["step"]], **r} for r in records]
    params = {
        name.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in job.model.named_parameters()
    }
    if env.is_main:
        Path(out).write_text(json.dumps(records))
        torch.save(params, Path(out).with_suffix(".pt"))
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_now(0)  # the output is written; interpreter finalization can abort in gloo (see exit_now)
