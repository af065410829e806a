"""harness: declarative post-local SGD / model averaging on FSDP2 (see README.md)."""

from harness.loop import run

__all__ = ["run"]
