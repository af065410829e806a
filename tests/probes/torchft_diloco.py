"""torchrun entry for tests: the harness's model, data and optimizers trained by
torchft's `DiLoCo` (torchft 0.2.0), to hold the harness's DiLoCo against it.

Usage: torchrun --nproc-per-node R tests/probes/torchft_diloco.py OUT.pt [hydra overrides...]
Each rank is one replica holding the whole model (as `sharding=no_shard`): built
and materialised as the harness does from `train.seed`, fed the rank's batches of
the harness's data stream, stepped by the local optimizer the config builds;
torchft's `DiLoCo` (one fragment, `sync_every=averager.period`, the outer
optimizer the config builds) wraps it with a stand-in `Manager` whose allreduce
is a real gloo all-reduce averaged over the replicas, as torchft's own unit
tests stand one in. Writes OUT.pt (rank 0): every rank's final parameters and
its per-step losses.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torchft.local_sgd import DiLoCo

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.config import register_configs  # noqa: E402
from harness.data import build_data  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.models import build_model, materialize  # noqa: E402
from harness.optim import build_optimizer  # noqa: E402
from harness.rng import seed_rank  # noqa: E402


class GlooManager:
    """The part of torchft's `Manager` that `DiLoCo` calls, over the default process
    group: every replica always takes part and every step commits."""

    _use_async_quorum = False  # DiLoCo refuses a manager that computes quorums asynchronously

    def __init__(self) -> None:
        self.step = 0

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> dist.Work:
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        tensor.div_(dist.get_world_size())
        return work

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def register_state_dict_fn(self, *args) -> None:
        pass


def main(out: str, overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["wandb.mode=disabled", *overrides])
    env = init_distributed(cfg.train.device, cfg.dist.timeout_s, cfg.dist.threads_per_rank)
    seed_rank(cfg.train.seed, env.rank)
    model = build_model(cfg.model, cfg.train.seq_len)
    materialize(model, env.device, cfg.train.seed)
    inner = build_optimizer(cfg.optimizer, model.parameters(), env.device)
    outer = build_optimizer(cfg.averager.outer_optimizer, model.parameters(), env.device)
    data = build_data(cfg, env.rank, env.world_size, env.device)
    losses = []
    with DiLoCo(GlooManager(), [model], inner, outer, sync_every=cfg.averager.period):
        for _ in range(cfg.train.steps):
            tokens, targets = data.next_batch()
            loss = model(tokens, targets)
            loss.backward()
            inner.step()
            inner.zero_grad(set_to_none=True)
            losses.append(loss.item())
    params = [None] * env.world_size
    dist.all_gather_object(params, {name: p.detach().cpu() for name, p in model.named_parameters()})
    every_loss = [None] * env.world_size
    dist.all_gather_object(every_loss, losses)
    if env.is_main:
        torch.save({"params": params, "losses": every_loss}, out)
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_now(0)  # the output is written; interpreter finalization can abort in gloo (see exit_now)
