"""2 ranks, one replica each: a `Pace`'s exchange of figures and the weighted means it asks for,
through real gloo collectives. Writes OUT.json (rank 0).

Usage: python tests/probes/local_ranks.py 2 tests/probes/pace_probe.py OUT.json
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.averaging.collectives import average_local_shards  # noqa: E402
from harness.averaging.diloco import start_means  # noqa: E402
from harness.averaging.pace import Pace  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402


def main(out: str) -> None:
    env = init_distributed("cpu", 60, 1)
    rank, world = env.rank, dist.group.WORLD
    pace = Pace(4, 0, 100, "time", "adacomm", 1, 2, rank, True, 8, torch.device("cpu"))
    # the period that ends: 4 local steps each (as after the first measured one), rank 1 twice as slow
    pace.local_steps, pace.first_step, pace.began, pace.exchanges = [4, 4], 1, 1, 2
    pace.first_loss = 4.0
    pace.loss = torch.tensor(1.0 + 2 * rank)  # the replicas' mean: 2.0, so adacomm's period is ceil(sqrt(1/2) 4) = 3
    pace.started = time.perf_counter() - 0.4 * (rank + 1)  # 0.1 s a step on rank 0, 0.2 on rank 1
    completed = pace.exchange(step=4)
    pace.windows = [[3, 1]]  # as if the period had been 3 steps of rank 0's and 1 of rank 1's
    scale = pace.weights([3, 1])
    x = torch.full((6,), 1.0 + 2 * rank)  # rank 0 holds 1, rank 1 holds 3
    params = [x.clone()]
    average_local_shards(params, world, torch.float32, scale)
    narrow = [x.clone()]
    average_local_shards(narrow, world, torch.bfloat16, scale)
    means, collectives = start_means([x.clone()], world, torch.float32, scale)
    for collective in collectives:
        collective.wait()
    result = {
        "completed": completed,
        "plan": pace.local_steps,
        "period": pace.period,
        "step_times": pace.step_times,
        "first_step": pace.first_step,
        "row": {k: v for k, v in pace.row.items()},
        "scale": scale,
        "mean": params[0].tolist(),
        "mean_bf16": narrow[0].tolist(),
        "pseudo_gradient_mean": means[0].tolist(),
    }
    pace.windows = [[4, 4]]
    result["equal_weights"] = pace.weights([4, 4])
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    teardown()
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1])
