"""2 ranks, one replica each: a `Clock`'s exchange of figures and the weighted means it asks for,
through real gloo collectives. Writes OUT.json (rank 0).

Usage: python tests/probes/local_ranks.py 2 tests/probes/clock_probe.py OUT.json
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
from harness.clock import Clock, Schedule  # noqa: E402
from harness.dist import init_distributed, teardown  # noqa: E402
from harness.launch.exit import exit_now  # noqa: E402


def main(out: str) -> None:
    env = init_distributed("cpu", 60, 1)
    rank, world = env.rank, dist.group.WORLD
    schedule = Schedule(warmup=0, period=4, first=4, balance="time", period_schedule="adacomm")
    clock = Clock(schedule, 100, 2, rank, True, 8, torch.device("cpu"))
    # the last step of a period of 4 local steps each (the second: measured), F0 = 4
    state = {"step": 7, "replicas": 2, "done": 8, "taken": [3, 3], "syncs": 1, "trained": [4, 4], "held": [[0, 0]]}
    state |= {"step_times": [None, None], "first_loss": 4.0, "first_loss_shared": True, "exchange_loss": None}
    state |= {"exchange_time": None}
    clock.load_state_dict(state)
    # 0.1 s a step on rank 0, 0.15 on rank 1: 2 of adacomm's 3 steps, far from round()'s boundary (at 0.2, 1.5
    # steps, a loaded host's delay before `computed` tipped the plan to 1)
    clock.started = time.perf_counter() - 0.4 * (1 + rank / 2)
    assert clock.next().exchange == 0
    clock.computed(torch.tensor(1.0 + 2 * rank))  # the replicas' mean: 2.0: adacomm's period ceil(sqrt(1/2) 4) = 3
    first = clock.exchange()
    clock.exchanged(committed=True)
    clock.applied(0)
    row = clock.take_row()
    clock.advance()
    result = {"rank": rank, "plan": clock.plan, "period": clock._stride(), "step_times": clock.step_times, "row": row}
    result["first_scale"] = first.scale  # 4 and 4 steps: the plain mean
    while clock.next().exchange is None:  # rank 0 takes 3 steps, rank 1 two
        clock.computed(torch.tensor(1.0))
        clock.advance()
    clock.computed(torch.tensor(1.0))
    scale = clock.exchange().scale
    x = torch.full((6,), 1.0 + 2 * rank)  # rank 0 holds 1, rank 1 holds 3
    params = [x.clone()]
    average_local_shards(params, world, torch.float32, scale)
    narrow = [x.clone()]
    average_local_shards(narrow, world, torch.bfloat16, scale)
    means, collectives = start_means([x.clone()], world, torch.float32, [scale])
    for collective in collectives:
        collective.wait()
    result |= {"scale": scale, "mean": params[0].tolist(), "mean_bf16": narrow[0].tolist()}
    result["pseudo_gradient_mean"] = means[0].tolist()
    gathered = [None, None]
    dist.all_gather_object(gathered, result["scale"])
    if rank == 0:
        Path(out).write_text(json.dumps({**result, "scale": gathered}))
    dist.barrier()
    teardown()
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1])
