"""Errors raised by the label-DP layer.

Everything subclasses ``ValueError`` so callers validating input can catch one family; each
message names the argument and, for arrays, the first offending position and value.
"""

from __future__ import annotations

from core.dp.errors import PrivacyParameterError


class LabelDPError(ValueError):
    """Base class for every label-DP input error."""


class InvalidEpsilonError(LabelDPError, PrivacyParameterError):
    """A privacy budget is not a finite positive number (or a split of it is unusable)."""


class InvalidPriorError(LabelDPError):
    """Label values or prior weights are unusable (unsorted, negative, NaN, all zero...)."""


class InvalidLabelError(LabelDPError):
    """Labels are empty, NaN, outside the declared range or not on the mechanism's grid."""


class UnknownLossError(LabelDPError):
    """The loss name is not one of the supported regression losses."""
