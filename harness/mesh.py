"""The one (replicate x shard) device mesh every sharding strategy lives on."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

HYBRID = ("hybrid_shard", "hybrid_shard_zero2")
# What each strategy implies for `sharding.replicate` when it is not hybrid.
_FIXED_REPLICATE = {"full_shard": "one", "shard_grad_op": "one", "no_shard": "world", "ddp": "world"}


def default_replicas(world_size: int, local_world_size: int) -> int:
    """`sharding.replicate` for a hybrid strategy left at null: one replica per
    node (shard inside a node over its fast links, average across nodes over
    the slow ones - FSDP1 HYBRID_SHARD's layout). A single node has nothing to
    go by, so it gets 2 replicas, the smallest layout with something to average,
    when its ranks split evenly; else (one GPU, or an odd count) one replica."""
    nodes = world_size // local_world_size
    return nodes if nodes > 1 else 2 if world_size % 2 == 0 else 1


def describe_replicas(mesh: DeviceMesh, node_of_rank: list[int]) -> str:
    """Which ranks, on which nodes, make up each replica: `replica 0 = ranks [0, 1] on node 0; ...`."""
    parts = []
    for replica, ranks in enumerate(mesh.mesh.tolist()):
        nodes = sorted({node_of_rank[r] for r in ranks})
        parts.append(
            f"replica {replica} = ranks {ranks} on node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"
        )
    return "; ".join(parts)


def mesh_shape(
    strategy: str, replicate: int | None, world_size: int, local_world_size: int | None = None
) -> tuple[int, int]:
    """(replicate, shard) sizes for a strategy; ValueError names key, value and fix.
    `local_world_size` (ranks per node) places hybrid replicas left at null."""
    if world_size < 1:  # `validate` names the key that asked for no ranks (launcher.nproc)
        raise ValueError(f"a world of {world_size} ranks has no (replicate, shard) mesh.")
    if strategy in HYBRID:
        given = replicate
        if replicate is None:
            replicate = default_replicas(world_size, local_world_size or world_size)
        if replicate < 1 or world_size % replicate:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            value = given if given is not None else f"null (one replica per node: {replicate})"
            raise ValueError(
                f"sharding.replicate={value} does not divide the world size {world_size}, so the "
                f"(replicate, shard) mesh cannot be built. Fix: sharding.replicate=one of {divisors}, "
                f"or change the number of ranks."
            )
        return replicate, world_size // replicate
    implied = 1 if _FIXED_REPLICATE[strategy] == "one" else world_size
    if replicate is not None and replicate != implied:
        raise ValueError(
            f"sharding.replicate={replicate} conflicts with sharding={strategy}, which always has "
            f"{implied} replica(s) at world size {world_size}. Fix: drop sharding.replicate, or use "
            f"sharding=hybrid_shard sharding.replicate={replicate}."
        )
    return implied, world_size // implied


def build_mesh(replicate: int, shard: int, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
