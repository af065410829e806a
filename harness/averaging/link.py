"""The replica link: everything that crosses replicas goes through one of these
(docs/design.md#replica-groups-the-mesh-under-fault-tolerance).

A link has a size (the replicas it joins now), the three collectives the
averagers' `mean_over_group` uses, and two calls that bracket an exchange:
`begin()` before a step whose end crosses replicas, `commit()` before its
result is used (`failed()` tells early that it will not). `MeshLink` is the
mesh's replicate (sub)group: nothing to begin, always committed.
`harness.fault_tolerance.TorchftLink` is torchft's Manager: a quorum, a
process group that changes with it, and `should_commit`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Work(Protocol):
    def wait(self) -> object: ...


class ReplicaLink(Protocol):
    needs_commit: bool  # an exchange's result may be used only once `commit()` said so

    def size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> Work: ...

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> Work: ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work: ...

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        """Sum a tensor already summed over this rank's world across the replicas the world does not hold."""

    def sum_over_members(self, tensor: torch.Tensor) -> None:
        """Sum a tensor over every rank of the replicas this link joins (their shards included), in place."""

    def begin(self, steps_done: int = 0) -> None:
        """Before the step after `steps_done` steps, when it crosses replicas."""

    def commit(self) -> bool: ...

    def failed(self) -> bool:
        """An exchange since `begin()` failed, so it will not commit."""


class MeshLink:
    """Replicas that are ranks of one world: a process group of the mesh (its
    replicate group, or a subgroup of it: then `shards`, the mesh's shard group).
    The world holds every replica, so a sum over the world already spans them."""

    needs_commit = False

    def __init__(self, group: dist.ProcessGroup, shards: dist.ProcessGroup | None = None):
        self.group, self.shards = group, shards

    def size(self) -> int:
        return self.group.size()

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        return dist.all_to_all_single(output, input, group=self.group, async_op=True)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        return dist.all_gather_into_tensor(output, input, group=self.group, async_op=True)

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        pass

    def sum_over_members(self, tensor: torch.Tensor) -> None:
        if self.shards is None:  # every replica: the world
            dist.all_reduce(tensor)
            return
        # a subgroup's members alone: other subgroups may meet at other times (balance=time's levels)
        dist.all_reduce(tensor, group=self.group)
        dist.all_reduce(tensor, group=self.shards)

    def begin(self, steps_done: int = 0) -> None:
        pass

    def commit(self) -> bool:
        return True

    def failed(self) -> bool:
        return False


def as_link(group: ReplicaLink | dist.ProcessGroup) -> ReplicaLink:
    """A link, given a link or a process group of the mesh."""
    return MeshLink(group) if isinstance(group, dist.ProcessGroup) else group
