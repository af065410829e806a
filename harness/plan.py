"""What the config and the world decide together, worked out once before any
rank starts and passed to every rank (torchtitan's `ParallelDims` plays this
part): the mesh shape, whether replicas train alone between averagings, and
the checkpoint the run resumes from. Nothing downstream derives these again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness import fault_tolerance
from harness.checkpoint_paths import groups_at_one_step, run_resume_path
from harness.mesh import mesh_shape


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    replicate: int  # replicas on the (replicate, shard) mesh
    shard: int  # ranks per replica
    averaging: bool  # an averager runs: replicas train alone between averagings (post-local SGD, DiLoCo)
    resume_from: Path | None  # the checkpoint `checkpoint.resume` picks, None to start fresh
    # fault_tolerance=torchft: this process's replica group, a world of `shard` ranks whose mesh is
    # (1, shard); `replicate` counts the groups, joined by torchft's Manager. None: one world, the whole mesh
    replica_id: int | None = None
    # a run of one world resuming a fault-tolerant run's replica groups: the other groups' checkpoints at the
    # step of `resume_from`, one of them; every replica starts from the mean of their models
    resume_with: tuple[Path, ...] = ()

    @property
    def group_world_size(self) -> int:
        """The ranks of this process's world: the whole mesh, or one replica group."""
        return self.world_size if self.replica_id is None else self.shard

    def rank_in_mesh(self, rank: int) -> int:
        """A rank of this world as a rank of the whole (replicate, shard) mesh."""
        return rank if self.replica_id is None else self.replica_id * self.shard + rank


def averager_configured(cfg: DictConfig) -> bool:
    """`averager` names a class (anything but `averager=none`)."""
    return cfg.averager.get("_target_") is not None


def plan_run(cfg: DictConfig, world_size: int, local_world_size: int, run_dir: Path) -> RunPlan:
    """The plan for `cfg` on `world_size` ranks (`local_world_size` per node);
    `cfg` has passed `validate`, so the mesh shape exists."""
    replicate, shard = mesh_shape(cfg.sharding.strategy, cfg.sharding.replicate, world_size, local_world_size)
    resume_from = run_resume_path(cfg.checkpoint, run_dir, fault_tolerance.enabled(cfg))
    groups = [] if fault_tolerance.enabled(cfg) else groups_at_one_step(cfg.checkpoint, run_dir)
    return RunPlan(
        world_size=world_size,
        replicate=replicate,
        shard=shard,
        averaging=averager_configured(cfg),
        resume_from=resume_from,
        resume_with=tuple(p for p in groups if p != resume_from) if resume_from in groups else (),
    )
