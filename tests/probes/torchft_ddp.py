"""One replica group of torchft's own fault-tolerant data parallelism (torchft 0.2.0), to hold
the harness's synchronous replica groups (`fault_tolerance=torchft averager=none`) against it.

Usage: python tests/probes/torchft_ddp.py OUT.pt REPLICA_ID GROUPS LIGHTHOUSE [hydra overrides...]
One process is one replica group of one rank holding the whole model (as `sharding=no_shard`):
built and materialised as the harness does from `train.seed`, fed replica REPLICA_ID's batches
of the harness's data stream (of GROUPS replicas), stepped by the local optimizer the config
builds, wrapped in torchft's `DistributedDataParallel` and `OptimizerWrapper` over a real
`Manager` (its own store, the lighthouse at LIGHTHOUSE): a quorum at zero_grad, the gradients'
mean across the groups through the Manager's gloo process group, `should_commit` before the
step. Writes OUT.pt: its final parameters and per-step losses.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.config import register_configs  # noqa: E402
from harness.data import build_data  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402
from harness.models import build_model, materialize  # noqa: E402
from harness.optim import build_optimizer  # noqa: E402
from harness.rng import seed_rank  # noqa: E402


def main(out: str, replica_id: int, groups: int, lighthouse: str, overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["wandb.mode=disabled", *overrides])
    torch.set_num_threads(1)  # as the runs it is held against: dist.threads_per_rank=1
    device = torch.device("cpu")
    seed_rank(cfg.train.seed, replica_id)
    model = build_model(cfg.model, cfg.train.seq_len)
    materialize(model, device, cfg.train.seed)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=groups,
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        replica_id=str(replica_id),
        init_sync=False,  # every group starts from the same seeded weights, as the harness's
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, build_optimizer(cfg.optimizer, model.parameters(), device))
    data = build_data(cfg, replica_id, groups, device)
    losses = []
    for _ in range(cfg.train.steps):
        optimizer.zero_grad(set_to_none=True)  # torchft: the step's quorum
        tokens, targets = data.next_batch()
        loss = ddp(tokens, targets)
        loss.backward()
        optimizer.step()  # torchft: only if should_commit
        losses.append(loss.item())
    torch.save({"params": {name: p.detach() for name, p in model.named_parameters()}, "losses": losses}, out)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
    exit_now(0)  # the output is written; interpreter finalization can abort in gloo (see exit_now)
