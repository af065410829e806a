"""The run's one clock (docs/design.md#one-clock): for each local step a replica takes, what that step
is: the run's global step and how far the learning-rate schedule moves, which data slot it reads,
whether its gradients cross replicas, whether every replica exchanges after it (and which fragment), a
hierarchy's group meeting, DiLoCo's delayed apply, whether every rank meets at it (so log, eval, save and
the non-finite report may fall there), and whether it ends the run.

`Clock` (clock.py) is the one authority the loop owns and every other part asks; `Schedule` and `Tick`
(tick.py) are what it is told and what it answers; `rules` are the plan's pure rules (AdaComm's period,
balancing by time, the weights of a mean, a hierarchy's meeting points).
"""

from harness.clock.clock import Clock, Exchange
from harness.clock.tick import SYNCHRONOUS, Level, Schedule, Tick

__all__ = ["SYNCHRONOUS", "Clock", "Exchange", "Level", "Schedule", "Tick"]
