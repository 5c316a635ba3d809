"""Helpers for tests that audit what crossed the channel."""

from __future__ import annotations

from typing import Any

import numpy as np


def arrays_in(value: Any) -> list[np.ndarray]:
    """Every numpy array inside a decoded message."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays_in(v)]
    if isinstance(value, list):
        return [a for v in value for a in arrays_in(v)]
    return []
