"""The one (replicate x shard) device mesh every sharding strategy lives on."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "ddp")
HYBRID = ("hybrid_shard", "hybrid_shard_zero2")
# What each strategy implies for `sharding.replicate` when it is not hybrid.
_FIXED_REPLICATE = {"full_shard": "one", "shard_grad_op": "one", "no_shard": "world", "ddp": "world"}


def mesh_shape(strategy: str, replicate: int | None, world_size: int) -> tuple[int, int]:
    """(replicate, shard) sizes for a strategy; ValueError names key, value and fix."""
    if strategy in HYBRID:
        if replicate is None:
            raise ValueError(f"sharding={strategy} needs sharding.replicate (how many replicas of the model). "
                             f"Fix: e.g. sharding.replicate=2 (must divide the world size, {world_size}).")
        if replicate < 1 or world_size % replicate:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"sharding.replicate={replicate} does not divide the world size {world_size}, so the "
                             f"(replicate, shard) mesh cannot be built. Fix: sharding.replicate=one of {divisors}, "
                             f"or change the number of ranks.")
        return replicate, world_size // replicate
    implied = 1 if _FIXED_REPLICATE[strategy] == "one" else world_size
    if replicate is not None and replicate != implied:
        raise ValueError(f"sharding.replicate={replicate} conflicts with sharding={strategy}, which always has "
                         f"{implied} replica(s) at world size {world_size}. Fix: drop sharding.replicate, or use "
                         f"sharding=hybrid_shard sharding.replicate={replicate}.")
    return implied, world_size // implied


def build_mesh(strategy: str, replicate: int | None, world_size: int, device_type: str) -> DeviceMesh:
    shape = mesh_shape(strategy, replicate, world_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
