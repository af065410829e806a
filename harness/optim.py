"""The local optimizer, built from `cfg.optimizer` by Hydra's `instantiate`.

Any `torch.optim` class is one YAML file away: `_target_` names the class,
`_partial_: true` leaves the parameters to be filled in here.
"""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig


def build_optimizer(cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    return instantiate(cfg, _convert_="all")(model.parameters())
