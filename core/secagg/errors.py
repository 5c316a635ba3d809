"""Errors raised by secure aggregation.

All of them subclass ``ValueError`` so that callers validating input can catch one family,
and each message names the party (and element, where relevant) that caused it.
"""

from __future__ import annotations


class SecAggError(ValueError):
    """Base class for every secure-aggregation failure."""


class ConfigError(SecAggError):
    """The session configuration is unusable (bad threshold, duplicate party names, ...)."""


class FixedPointError(SecAggError):
    """A value cannot be encoded into the ring without risking a wrapped (wrong) sum."""


class InsufficientSurvivorsError(SecAggError):
    """Fewer than ``threshold`` parties are left at some stage, so the round must abort.

    Nothing is produced: continuing would either fail to unmask or weaken the guarantee that
    no coalition smaller than the threshold can learn a single party's input.
    """


class ProtocolViolationError(SecAggError):
    """A message breaks the protocol (wrong stage, wrong session, unsafe unmask request, ...).

    Raised instead of answering, because answering some of these requests would reveal both
    secrets of one party and hence its plain input.
    """
