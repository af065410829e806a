"""The averagers' one primitive: a bucketed mean of each rank's local shards
over a replicate (sub)group, in float32 or sent in a narrower dtype."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from harness.averaging.link import ReplicaLink, as_link
from harness.dist import local_view, synchronize

BUCKET_BYTES = 64 * 2**20  # cap on one flat all-reduce buffer


@torch.no_grad()
def average_local_shards(
    params, group: ReplicaLink | dist.ProcessGroup, comm_dtype: torch.dtype, scale: float | None = None
) -> tuple[float, int, float | None]:
    """Average the local shards of `params` (tensors or param groups) over `group`, in place;
    with `scale`, each member's shards are scaled by its own `scale` first (a weighted mean:
    `Clock.exchange`).

    Returns (seconds, bytes sent, drift), where drift is how far the members
    had drifted apart just before: sqrt(sum ||x_r - mean||^2 / sum ||mean||^2)
    over every member rank's shards, from the same buffers (a 2-float sum over
    the members alone: a subgroup does not wait for the others).
    A link that must commit (fault tolerance) gets the means applied only once
    it has: until then they are kept aside (one more copy of the local shards),
    and a drift of None says nothing was applied.
    """
    link = as_link(group)
    tensors = [local_view(p) for p in _flatten(params)]
    device = tensors[0].device
    synchronize(device)  # the clock measures the averaging alone, finished
    start, nbytes = time.perf_counter(), 0
    deviation = torch.zeros(2, dtype=torch.float64, device=device)  # [sum dev^2, sum mean^2]
    pending = []
    for indices in buckets(tensors):
        bucket = [tensors[i] for i in indices]
        local = torch.cat([t.reshape(-1) for t in bucket])
        mean = local.clone() if scale is None else local * scale
        nbytes += mean_over_group(mean, link, comm_dtype)
        deviation[0] += local.sub_(mean).pow_(2).sum()
        deviation[1] += mean.square().sum()
        means = [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in bucket]), bucket)]
        if link.needs_commit:
            pending.append((bucket, means))
        else:
            torch._foreach_copy_(bucket, means)
    synchronize(device)
    elapsed = time.perf_counter() - start
    link.sum_over_members(deviation)
    if not link.commit():
        return elapsed, nbytes, None
    for bucket, means in pending:
        torch._foreach_copy_(bucket, means)
    return elapsed, nbytes, (deviation[0] / deviation[1].clamp_min(1e-30)).sqrt().item()


def mean_over_group(flat: torch.Tensor, group: ReplicaLink | dist.ProcessGroup, comm_dtype: torch.dtype) -> int:
    """Replace the 1-D `flat` by its mean over `group`; returns the bytes sent.

    In its own dtype: one all-reduce. In a narrower `comm_dtype` (bf16): an
    all-reduce in that dtype would also *sum* in it, so instead each rank gets
    its 1/n chunk of every member's copy (all-to-all), sums those in fp32 and
    all-gathers the means - the reduce-scatter + all-gather of a ring
    all-reduce, with every byte on the wire in `comm_dtype`. In 8 bits (int8,
    float8_e4m3fn) the same path sends each block of `QUANT_BLOCK` values with
    its fp32 scale (`quantize`), both ways.
    """
    mean = start_mean_over_group(flat, group, comm_dtype)
    mean.wait()
    return mean.nbytes


class MeanInFlight:
    """A `start_mean_over_group` under way, sending `nbytes`, as its `stages`: each
    waits for the collective under way and starts the next; the last one leaves the
    mean in `flat`. `advance()` runs every stage but the last (so a narrow dtype's
    all-gather starts while training goes on); `wait()` runs what remains, later
    calls return at once."""

    def __init__(self, stages: list[Callable[[], None]], nbytes: int):
        self._stages, self.nbytes = stages, nbytes

    def advance(self) -> None:
        while len(self._stages) > 1:
            self._stages.pop(0)()

    def wait(self) -> None:
        while self._stages:
            self._stages.pop(0)()


def start_mean_over_group(
    flat: torch.Tensor, group: ReplicaLink | dist.ProcessGroup, comm_dtype: torch.dtype
) -> MeanInFlight:
    """`mean_over_group`, started: its first collective is issued asynchronously (the
    whole all-reduce in the tensor's own dtype; the all-to-all of a narrower
    dtype, whose fp32 sum and all-gather run in `advance()` or `wait()`)."""
    group = as_link(group)
    n = group.size()
    if comm_dtype == flat.dtype:
        work = group.all_reduce(flat)

        def finish() -> None:
            work.wait()
            flat.div_(n)

        return MeanInFlight([finish], flat.numel() * flat.element_size())
    if comm_dtype in EIGHT_BIT_MAX:
        return _start_mean_in_8_bits(flat, group, comm_dtype)
    chunk = -(-flat.numel() // n)
    sent = torch.zeros(chunk * n, dtype=comm_dtype, device=flat.device)
    sent[: flat.numel()].copy_(flat)
    received = torch.empty_like(sent)
    works = [group.all_to_all_single(received, sent)]
    kept: list[torch.Tensor] = []

    def gather_means() -> None:
        works[0].wait()
        mine = received.view(n, chunk).float().sum(0).div_(n).to(comm_dtype)
        works[0] = group.all_gather_into_tensor(sent, mine)
        kept.append(mine)  # alive until its all-gather is done

    def finish() -> None:
        works[0].wait()
        flat.copy_(sent[: flat.numel()])

    return MeanInFlight([gather_means, finish], flat.numel() * sent.element_size())


QUANT_BLOCK = 1024  # values per fp32 scale in 8-bit communication: 0.4 % of the bytes go to scales
# largest magnitude of each 8-bit format, onto which a block's largest value is scaled
EIGHT_BIT_MAX = {torch.int8: 127.0, **({torch.float8_e4m3fn: 448.0} if hasattr(torch, "float8_e4m3fn") else {})}


def quantize(blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `blocks` (rows of QUANT_BLOCK values) as 8-bit values and one fp32 scale per row:
    the row's largest magnitude maps to the format's largest. int8 rounds to nearest, so a
    value is off by at most half a step, scale / 2 = max|row| / 254; float8_e4m3fn keeps 3
    mantissa bits, a relative error of at most 2^-4."""
    scales = blocks.abs().amax(dim=1).div_(EIGHT_BIT_MAX[dtype]).clamp_min_(torch.finfo(torch.float32).tiny)
    scaled = blocks / scales[:, None]
    values = scaled.round_().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return values.float() * scales[:, None]


def _start_mean_in_8_bits(flat: torch.Tensor, group: ReplicaLink, dtype: torch.dtype) -> MeanInFlight:
    """`start_mean_over_group` with 8-bit values and per-block fp32 scales on the
    wire: each rank's chunk of every member's blocks (all-to-all), dequantised and
    summed in fp32, then the quantised means all-gathered. The bytes sent are the
    values plus the scales of the padded buffer (whole blocks per rank)."""
    n = group.size()
    per_rank = -(-flat.numel() // (n * QUANT_BLOCK)) * QUANT_BLOCK
    padded = torch.zeros(n * per_rank, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()].copy_(flat)
    values, scales = quantize(padded.view(-1, QUANT_BLOCK), dtype)
    # as bytes: gloo has no 8-bit float type, and all-to-all moves bytes all the same
    got_values, got_scales = torch.empty_like(values), torch.empty_like(scales)
    works = [
        group.all_to_all_single(got_values.view(torch.uint8), values.view(torch.uint8)),
        group.all_to_all_single(got_scales, scales),
    ]
    kept: list[torch.Tensor] = []

    def gather_means() -> None:
        for work in works:
            work.wait()
        mine = dequantize(got_values, got_scales).view(n, per_rank).sum(0).div_(n)
        mine_values, mine_scales = quantize(mine.view(-1, QUANT_BLOCK), dtype)
        works[:] = [
            group.all_gather_into_tensor(values.view(torch.uint8), mine_values.view(torch.uint8)),
            group.all_gather_into_tensor(scales, mine_scales),
        ]
        kept.extend([mine_values, mine_scales])  # alive until their all-gathers are done

    def finish() -> None:
        for work in works:
            work.wait()
        flat.copy_(dequantize(values, scales).view(-1)[: flat.numel()])

    nbytes = values.numel() * values.element_size() + scales.numel() * scales.element_size()
    return MeanInFlight([gather_means, finish], nbytes)


def _flatten(params) -> list[torch.Tensor]:
    out = []
    for p in params:
        out.extend(p["params"] if isinstance(p, dict) else [p])
    return out


def buckets(tensors: list[torch.Tensor]):
    """Indices into `tensors`, in runs of one dtype and at most BUCKET_BYTES (or one tensor)."""
    bucket, nbytes = [], 0
    for i, t in enumerate(tensors):
        if bucket and (nbytes + t.numel() * t.element_size() > BUCKET_BYTES or t.dtype != tensors[bucket[0]].dtype):
            yield bucket
            bucket, nbytes = [], 0
        bucket.append(i)
        nbytes += t.numel() * t.element_size()
    if bucket:
        yield bucket


def replica_subgroups(mesh: DeviceMesh, group_size: int) -> dist.ProcessGroup:
    """This rank's group of `group_size` consecutive replicas (same shard index);
    the replicate group itself when the group holds every replica."""
    ranks = mesh.mesh  # [replicate, shard] tensor of global ranks
    if group_size == ranks.shape[0]:
        return mesh.get_group("replicate")
    groups = [
        ranks[first : first + group_size, shard].tolist()
        for shard in range(ranks.shape[1])
        for first in range(0, ranks.shape[0], group_size)
    ]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine
