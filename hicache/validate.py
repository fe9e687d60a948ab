"""Small checks shared by every public entry point's argument validation."""

from __future__ import annotations

from typing import Any, TypeGuard


def is_int(value: Any) -> TypeGuard[int]:
    """Whether `value` is an int and not a bool (True is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)
