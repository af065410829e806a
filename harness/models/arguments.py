"""Constructor-argument checks the models share: each refusal names the key, the value and the fix."""

from __future__ import annotations


def require_positive(**values: int) -> None:
    bad = [f"model.{k}={v}" for k, v in values.items() if v is None or v < 1]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} out of range: must be >= 1. "
            f"Fix: set {', '.join(b.split('=')[0] for b in bad)} to a positive integer."
        )


def require_probability(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout={dropout} must be in [0, 1). Fix: model.dropout=0.1, or 0.0 for none.")


def nearest_divisor(n: int, target: int) -> int:
    """The divisor of `n` closest to `target` (the larger on a tie): the fix a divisibility error suggests."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), -d))
