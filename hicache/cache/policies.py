"""Write and prefetch policy names and the prefetch timeout rule. No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")
SELECTIVE_HITS = 2  # write_through_selective stores a page when it is used for the second time


def check_write_policy(name: str) -> WritePolicy:
    """Return `name` if it is a write policy; raise ValueError naming it otherwise."""
    if name not in WRITE_POLICIES:
        raise ValueError(f"unknown write policy {name!r}; expected one of {list(WRITE_POLICIES)}")
    return name  # type: ignore[return-value]


def check_prefetch_policy(name: str) -> PrefetchPolicy:
    """Return `name` if it is a prefetch policy; raise ValueError naming it otherwise."""
    if name not in PREFETCH_POLICIES:
        raise ValueError(f"unknown prefetch policy {name!r}; expected one of {list(PREFETCH_POLICIES)}")
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class PrefetchTimeout:
    """How long the `timeout` policy waits for a prefetch, from the moment it started:
    min(max_s, base_s + per_ki_token_s * tokens / 1024). Raises ValueError for a negative or
    non-finite value, or max_s < base_s."""

    base_s: float = 1.0
    per_ki_token_s: float = 0.25
    max_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_ki_token_s", "max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"PrefetchTimeout.{name} must be a finite number >= 0, got {value!r}")
        if self.max_s < self.base_s:
            raise ValueError(f"PrefetchTimeout.max_s {self.max_s} is below base_s {self.base_s}")

    def seconds(self, tokens: int) -> float:
        """The allowance for a prefetch of `tokens` tokens."""
        return min(self.max_s, self.base_s + self.per_ki_token_s * tokens / 1024)
