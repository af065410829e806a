"""Replica groups that survive each other, on torchft (`fault_tolerance=torchft`).

Each replica of the mesh is a replica group: a world of its own whose mesh is
(1 x shard); the `replicate` dimension is torchft's `Manager`
(docs/design.md#replica-groups-the-mesh-under-fault-tolerance). One file per
concern:

- `config_rules`: whether it is on, what `validate` refuses, the lighthouse's
  join timeout, torchft's log level, the replica group of a torchrun;
  re-exported here (light: the plan and `validate` read them);
- `link`: `TorchftLink`, the replica link over the Manager (a quorum, its
  process group, `should_commit`);
- `replica_group`: `ReplicaGroup`, the trainer's side (the quorum at the start
  of every step that crosses replicas, the heal state it gives and takes);
- `outputs`: a group's own outputs and the marker of a finished group.

The trainer's pieces are imported from their modules (`harness.loop` does), not
from here: they build on checkpoints, which build on the plan, which reads
`enabled` here.
"""

from harness.fault_tolerance.config_rules import (
    LIGHTHOUSE_ENV,
    NEEDS_TORCHFT,
    NUM_REPLICA_GROUPS,
    REPLICA_GROUP_ID,
    check_group_world,
    config_errors,
    enabled,
    join_timeout_s,
    quiet_torchft,
    torchrun_groups,
)

__all__ = [
    "LIGHTHOUSE_ENV",
    "NEEDS_TORCHFT",
    "NUM_REPLICA_GROUPS",
    "REPLICA_GROUP_ID",
    "check_group_world",
    "config_errors",
    "enabled",
    "join_timeout_s",
    "quiet_torchft",
    "torchrun_groups",
]
