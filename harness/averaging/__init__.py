"""What crosses replicas: post-local SGD (arXiv 1808.07217) and DiLoCo across
the `replicate` dimension of the mesh.

Until `warmup_steps` every step is synchronous: gradients are averaged across
replicas (`hooks`; a replica of one device's through its `gradient_reduction`).
From then on no gradient crosses replicas - each replica trains on its own
data - and where the run's clock says (harness/clock: each averager gives it
its `Schedule`), after the local optimizer step, an averager (`averagers`,
`diloco`) averages each rank's *local shard* of the parameters, or DiLoCo's
pseudo-gradients, over a replicate (sub)group (`collectives`), counting the
bytes (`traffic`). `cross_replica` wires it all up and is the `cross_replica`
checkpoint part; `config_rules` are the averagers' checks that `validate` runs.
"""

from harness.averaging.averagers import SCHEDULE_KEYS, HierarchicalReplicaAverager, ReplicaAverager
from harness.averaging.collectives import (
    BUCKET_BYTES,
    average_local_shards,
    buckets,
    mean_over_group,
    replica_subgroups,
)
from harness.averaging.cross_replica import (
    CrossReplica,
    averaging_schedule,
    local_optimizer,
    setup_cross_replica,
    step_without_update,
)
from harness.averaging.diloco import DiLoCoAverager, OuterState, outer_step, plan_fragments
from harness.averaging.gradient_reduction import GradientReduction
from harness.averaging.traffic import CrossReplicaTraffic

__all__ = [
    "BUCKET_BYTES",
    "SCHEDULE_KEYS",
    "CrossReplica",
    "CrossReplicaTraffic",
    "DiLoCoAverager",
    "GradientReduction",
    "HierarchicalReplicaAverager",
    "OuterState",
    "ReplicaAverager",
    "average_local_shards",
    "averaging_schedule",
    "buckets",
    "local_optimizer",
    "mean_over_group",
    "outer_step",
    "plan_fragments",
    "replica_subgroups",
    "setup_cross_replica",
    "step_without_update",
]
