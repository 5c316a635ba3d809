"""The one error type of the differential-privacy layer."""

from __future__ import annotations


class PrivacyParameterError(ValueError):
    """A privacy parameter (epsilon, delta, scale, sensitivity, size) is unusable; says which."""
