"""One accountant for a table's releases: each release is an *event*, the spend is their
composition, read as epsilon at the owner's delta.

Why: adding up epsilons and deltas (basic composition) overstates what repeated releases
cost; thirty releases at (1, 1e-6) add up to epsilon 30, while their privacy loss
distributions (PLDs) composed exactly give about 5.9 at delta 1e-5. The PLDs come from
Google's ``dp-accounting`` (``dp_accounting.pld``: pessimistic discretisation, so every figure
is an upper bound); its RDP accountant gives a looser second figure where it applies
(:func:`rdp_epsilon`), as a cross-check.

Events (:class:`Event`; each is a small JSON dict, see :meth:`Event.as_dict` and
:func:`event_from_dict`). Parameters describe the two output distributions of neighbouring
inputs under the release's own neighbour relation; a sensitivity is the largest shift between
them.

* :class:`Gaussian` (sensitivity, sigma): continuous noise; all Gaussians compose exactly into
  one (their (sensitivity/sigma)^2 add up).
* :class:`DiscreteGaussian` (sensitivity, sigma, shift) in steps of the noise's integer grid:
  ``scalar`` (one integer query), ``unit`` (each coordinate moves by 0 or 1: binary WALR) are
  exact; ``vector`` (any integer shift) has no exact PLD and is counted as the continuous
  Gaussian with one grid step added to the sensitivity, only on a grid of at least
  :data:`FINE_GRID_SIGMA` steps per sigma (refused below).
* :class:`Laplace`, :class:`DiscreteLaplace` (sensitivity, scale).
* :class:`RandomizedResponse` (epsilon, buckets): k-ary randomized response, exact.
* :class:`PureDP` (epsilon): any epsilon-DP mechanism (RR-on-Bins, exponential, staircase, a
  private prior), as the worst-case PLD of epsilon-DP.
* :class:`ApproximateDP` (epsilon, delta): what is known only by its pair, and every ledger
  row from before events were stored; the worst-case PLD of (epsilon, delta)-DP.
* :class:`Composed`: several events of one release (a prior and its channel).

A :class:`Charge` is an event with the (epsilon, delta) the caller calibrated it for. The
figure a ledger charges (:func:`composed_epsilon`) is the smaller of two upper bounds: the PLD
composition and the basic sum of those pairs (valid when their deltas add up to at most the
owner's delta), so composing never charges more than adding up did. An event dp-accounting
cannot compute raises :class:`AccountingError`: the caller refuses the release (fail closed).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache, reduce
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from core.dp.errors import PrivacyParameterError

if TYPE_CHECKING:  # dp-accounting is imported where a figure is computed (see _pld_lib)
    from dp_accounting import dp_event
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

__all__ = [
    "DISCRETISATION",
    "FINE_GRID_SIGMA",
    "MAX_RUNS",
    "AccountingError",
    "ApproximateDP",
    "Charge",
    "Composed",
    "DiscreteGaussian",
    "DiscreteLaplace",
    "Event",
    "Gaussian",
    "Laplace",
    "PureDP",
    "RandomizedResponse",
    "basic_epsilon",
    "composed_epsilon",
    "event_from_dict",
    "pld_epsilon",
    "rdp_epsilon",
    "runs_left",
]

DISCRETISATION = 1e-4
"""Width of the PLD's privacy-loss grid (dp-accounting's default); losses round up to it."""

FINE_GRID_SIGMA = 1024.0
"""Least sigma, in grid steps, at which a discrete Gaussian with an arbitrary integer shift is
counted as the continuous one (one step added to its sensitivity as a margin)."""

MAX_RUNS = 1000
""":func:`runs_left` stops counting here (the answer then reads "at least")."""

_TOLERANCE = 1e-12
_INTEGRAL = 1e-9


def _pld_lib() -> ModuleType:
    """dp-accounting's PLD module, imported on first use: with SciPy it costs about a second of
    CPU, which reading events (or a ledger's stored figures) does not need."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution


def _dp_event() -> ModuleType:
    """dp-accounting's event module (for the RDP cross-check), imported on first use."""
    from dp_accounting import dp_event

    return dp_event


class AccountingError(PrivacyParameterError):
    """An event that cannot be accounted (unknown, malformed, or beyond dp-accounting): the
    release it belongs to must be refused, never counted as free."""


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AccountingError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise AccountingError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _integral(name: str, value: float) -> int:
    nearest = round(value)
    if nearest < 1 or abs(value - nearest) > _INTEGRAL * max(nearest, 1):
        raise AccountingError(f"{name} must be a positive integer, got {value!r}")
    return int(nearest)


def _short(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Event(ABC):
    """One release's privacy, as dp-accounting can compose it."""

    mechanism: ClassVar[str]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form the ledger stores (``event_from_dict`` reads it back)."""
        return {"mechanism": self.mechanism, **asdict(self)}

    def describe(self) -> str:
        """``name(parameter=value, ...)`` for people reading a ledger."""
        shown = ", ".join(f"{f.name}={_short(getattr(self, f.name))}" for f in fields(self))
        return f"{self.mechanism}({shown})"

    def parts(self) -> tuple[Event, ...]:
        """The single events this one composes (itself, unless composed)."""
        return (self,)

    def gaussian_ratio(self) -> float | None:
        """sensitivity / sigma when the event is counted as a continuous Gaussian (those
        compose exactly into one), else None."""
        return None

    @abstractmethod
    def pld(self) -> PrivacyLossDistribution:
        """Its privacy loss distribution (pessimistic: an upper bound)."""

    @abstractmethod
    def rdp_event(self) -> dp_event.DpEvent | None:
        """The same release for dp-accounting's RDP accountant, or None where none applies."""


@dataclass(frozen=True)
class Gaussian(Event):
    """N(0, sigma^2) noise per coordinate on a query of L2 ``sensitivity``."""

    mechanism: ClassVar[str] = "gaussian"
    sensitivity: float
    sigma: float

    def __post_init__(self) -> None:
        _positive("sensitivity", self.sensitivity)
        _positive("sigma", self.sigma)

    def gaussian_ratio(self) -> float:
        return self.sensitivity / self.sigma

    def pld(self) -> PrivacyLossDistribution:
        return _pld_lib().from_gaussian_mechanism(
            self.sigma, sensitivity=self.sensitivity, value_discretization_interval=DISCRETISATION
        )

    def rdp_event(self) -> dp_event.DpEvent:
        return _dp_event().GaussianDpEvent(self.sigma / self.sensitivity)


SHIFTS = ("scalar", "unit", "vector")


@dataclass(frozen=True)
class DiscreteGaussian(Event):
    """N_Z(0, sigma^2) noise per coordinate; ``sigma`` and ``sensitivity`` in grid steps.

    ``shift`` says how neighbouring inputs differ: ``scalar``, one integer query by at most
    ``sensitivity`` (an integer); ``unit``, at most ``sensitivity^2`` coordinates by one step
    each (the privacy loss is then a sum over those coordinates, so the PLD is that many
    compositions of the scalar unit shift; fewer ones are post-processing of more);
    ``vector``, any integer vector of L2 norm at most ``sensitivity``.
    """

    mechanism: ClassVar[str] = "discrete_gaussian"
    sensitivity: float
    sigma: float
    shift: str = "scalar"

    def __post_init__(self) -> None:
        _positive("sensitivity", self.sensitivity)
        _positive("sigma", self.sigma)
        if self.shift not in SHIFTS:
            raise AccountingError(f"shift must be one of {', '.join(SHIFTS)}, got {self.shift!r}")
        if self.shift == "scalar":
            _integral("a scalar shift's sensitivity", self.sensitivity)
        elif self.shift == "unit":
            _integral("a unit shift's sensitivity^2", self.sensitivity**2)
        elif self.sigma < FINE_GRID_SIGMA:
            raise AccountingError(
                f"a discrete Gaussian with an arbitrary integer shift has no exact PLD; it is "
                f"counted as continuous only at sigma >= {FINE_GRID_SIGMA:g} grid steps, got "
                f"{self.sigma:g}"
            )

    def gaussian_ratio(self) -> float | None:
        return (self.sensitivity + 1.0) / self.sigma if self.shift == "vector" else None

    def pld(self) -> PrivacyLossDistribution:
        if self.shift == "vector":
            return Gaussian(self.sensitivity + 1.0, self.sigma).pld()
        scalar = self.shift == "scalar"
        step = _integral("sensitivity", self.sensitivity) if scalar else 1
        one = _pld_lib().from_discrete_gaussian_mechanism(
            self.sigma,
            sensitivity=step,
            value_discretization_interval=DISCRETISATION,
            use_connect_dots=True,
        )
        return one if scalar else one.self_compose(_integral("ones", self.sensitivity**2))

    def rdp_event(self) -> dp_event.DpEvent:
        """rho = sensitivity^2 / (2 sigma^2)-zCDP for any integer shift (Canonne, Kamath and
        Steinke 2020)."""
        norm = self.sensitivity + (1.0 if self.shift == "vector" else 0.0)
        return _dp_event().ZCDpEvent(norm**2 / (2.0 * self.sigma**2))


@dataclass(frozen=True)
class Laplace(Event):
    """Laplace noise of ``scale`` per coordinate on a query of L1 ``sensitivity``."""

    mechanism: ClassVar[str] = "laplace"
    sensitivity: float
    scale: float

    def __post_init__(self) -> None:
        _positive("sensitivity", self.sensitivity)
        _positive("scale", self.scale)

    def pld(self) -> PrivacyLossDistribution:
        return _pld_lib().from_laplace_mechanism(
            self.scale, sensitivity=self.sensitivity, value_discretization_interval=DISCRETISATION
        )

    def rdp_event(self) -> dp_event.DpEvent:
        return _dp_event().LaplaceDpEvent(self.scale / self.sensitivity)


@dataclass(frozen=True)
class DiscreteLaplace(Event):
    """P(x) proportional to exp(-|x| / scale) on the integers, on a scalar integer query of
    ``sensitivity`` (``core.dp.samplers.sample_discrete_laplace``)."""

    mechanism: ClassVar[str] = "discrete_laplace"
    sensitivity: int
    scale: float

    def __post_init__(self) -> None:
        _integral("sensitivity", _positive("sensitivity", self.sensitivity))
        _positive("scale", self.scale)

    def pld(self) -> PrivacyLossDistribution:
        return _pld_lib().from_discrete_laplace_mechanism(
            1.0 / self.scale,
            sensitivity=_integral("sensitivity", self.sensitivity),
            value_discretization_interval=DISCRETISATION,
        )

    def rdp_event(self) -> dp_event.DpEvent:
        return PureDP(self.sensitivity / self.scale).rdp_event()


@dataclass(frozen=True)
class RandomizedResponse(Event):
    """k-ary randomized response: the true bucket with probability e^eps / (e^eps + k - 1)."""

    mechanism: ClassVar[str] = "randomized_response"
    epsilon: float
    buckets: int

    def __post_init__(self) -> None:
        _positive("epsilon", self.epsilon)
        if isinstance(self.buckets, bool) or not isinstance(self.buckets, int):
            raise AccountingError(f"buckets must be an integer >= 2, got {self.buckets!r}")
        if self.buckets < 2:
            raise AccountingError(f"buckets must be an integer >= 2, got {self.buckets!r}")

    def pld(self) -> PrivacyLossDistribution:
        # dp-accounting's noise parameter p: the output is uniform with probability p
        noise = self.buckets / (math.exp(self.epsilon) + self.buckets - 1)
        return _pld_lib().from_randomized_response(
            noise, self.buckets, value_discretization_interval=DISCRETISATION
        )

    def rdp_event(self) -> dp_event.DpEvent:
        return PureDP(self.epsilon).rdp_event()


@dataclass(frozen=True)
class PureDP(Event):
    """Any epsilon-DP mechanism: counted as binary randomized response at epsilon, which
    dominates every epsilon-DP mechanism (Kairouz, Oh and Viswanath 2015)."""

    mechanism: ClassVar[str] = "pure"
    epsilon: float

    def __post_init__(self) -> None:
        _positive("epsilon", self.epsilon)

    def pld(self) -> PrivacyLossDistribution:
        return ApproximateDP(self.epsilon, 0.0).pld()

    def rdp_event(self) -> dp_event.DpEvent:
        """epsilon-DP implies epsilon^2/2-zCDP (Bun and Steinke 2016)."""
        return _dp_event().ZCDpEvent(self.epsilon**2 / 2.0)


@dataclass(frozen=True)
class ApproximateDP(Event):
    """What is known only as (epsilon, delta)-DP: the worst-case PLD of that pair."""

    mechanism: ClassVar[str] = "approximate"
    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise AccountingError(f"{name} must be a number, got {value!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise AccountingError(f"epsilon must be finite and >= 0, got {self.epsilon!r}")
        if not 0 <= self.delta < 1:
            raise AccountingError(f"delta must be in [0, 1), got {self.delta!r}")

    def pld(self) -> PrivacyLossDistribution:
        from dp_accounting.pld import common

        parameters = common.DifferentialPrivacyParameters(float(self.epsilon), float(self.delta))
        return _pld_lib().from_privacy_parameters(parameters, DISCRETISATION)

    def rdp_event(self) -> dp_event.DpEvent | None:
        return PureDP(self.epsilon).rdp_event() if self.delta == 0 and self.epsilon > 0 else None


@dataclass(frozen=True)
class Composed(Event):
    """Several mechanisms of one release (say a private prior, then a channel built on it)."""

    mechanism: ClassVar[str] = "composed"
    events: tuple[Event, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.events or not all(isinstance(e, Event) for e in self.events):
            raise AccountingError("a composed event needs one or more events")

    def as_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "events": [e.as_dict() for e in self.events]}

    def describe(self) -> str:
        return " + ".join(e.describe() for e in self.events)

    def parts(self) -> tuple[Event, ...]:
        return tuple(part for event in self.events for part in event.parts())

    def pld(self) -> PrivacyLossDistribution:
        return _compose_plds(_tally(self.parts()))

    def rdp_event(self) -> dp_event.DpEvent | None:
        inner = [e.rdp_event() for e in self.events]
        return None if None in inner else _dp_event().ComposedDpEvent(inner)


_KINDS: dict[str, type[Event]] = {
    kind.mechanism: kind
    for kind in (Gaussian, DiscreteGaussian, Laplace, DiscreteLaplace, RandomizedResponse,
                 PureDP, ApproximateDP)
}  # fmt: skip


def event_from_dict(data: Mapping[str, Any]) -> Event:
    """The event a ledger row stores; anything unknown or malformed raises AccountingError."""
    if not isinstance(data, Mapping):
        raise AccountingError(f"an event is a JSON object, got {data!r}")
    kind = data.get("mechanism")
    rest = {k: v for k, v in data.items() if k != "mechanism"}
    if kind == Composed.mechanism:
        inner = rest.pop("events", None)
        if rest or not isinstance(inner, list):
            raise AccountingError(f"a composed event holds only a list of events, got {data!r}")
        return Composed(tuple(event_from_dict(e) for e in inner))
    if kind not in _KINDS:
        raise AccountingError(f"unknown privacy event {kind!r} (known: {', '.join(_KINDS)})")
    try:
        return _KINDS[kind](**rest)
    except TypeError as error:
        raise AccountingError(f"a {kind} event with parameters {rest!r}: {error}") from None


@dataclass(frozen=True)
class Charge:
    """A release as a ledger row holds it: its event and the (epsilon, delta) it was
    calibrated for (what basic composition adds up)."""

    event: Event
    epsilon: float
    delta: float


@dataclass(frozen=True)
class _Tally:
    """Events in a form that composes fast: the continuous Gaussians folded into one
    (mu^2 = sum of (sensitivity/sigma)^2), every other event with its count."""

    gaussian: float
    counts: tuple[tuple[Event, int], ...]


def _tally(events: Iterable[Event] | Mapping[Event, int]) -> _Tally:
    pairs = events.items() if isinstance(events, Mapping) else ((e, 1) for e in events)
    gaussian, counts = 0.0, Counter[Event]()
    for event, count in pairs:
        for part in event.parts():
            ratio = part.gaussian_ratio()
            if ratio is None:
                counts[part] += count
            else:
                gaussian += count * ratio * ratio
    ordered = tuple(sorted(counts.items(), key=lambda item: repr(item[0])))
    return _Tally(gaussian, ordered)


@lru_cache(maxsize=64)
def _single_pld(event: Event) -> PrivacyLossDistribution:
    return event.pld()


@lru_cache(maxsize=16)
def _compose_plds(tally: _Tally) -> PrivacyLossDistribution:
    """The composed PLD (cached: a ledger asks for the same spends again and again; a few
    only, as one can hold millions of probabilities)."""
    plds = [_single_pld(event).self_compose(count) for event, count in tally.counts]
    if tally.gaussian > 0:
        plds.append(Gaussian(1.0, 1.0 / math.sqrt(tally.gaussian)).pld())
    if not plds:
        return _pld_lib().identity(DISCRETISATION)
    return reduce(lambda first, second: first.compose(second), plds)


def _checked_delta(delta: float) -> float:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 <= delta < 1:
        raise AccountingError(f"the owner's delta must be in [0, 1), got {delta!r}")
    return float(delta)


def _pld_figure(tally: _Tally, delta: float) -> float:
    if tally.gaussian == 0 and not tally.counts:
        return 0.0
    try:
        epsilon = float(_compose_plds(tally).get_epsilon_for_delta(_checked_delta(delta)))
    except AccountingError:
        raise
    except Exception as error:  # dp-accounting's own failures: refuse, never count as free
        raise AccountingError(f"dp-accounting could not compose the events: {error}") from error
    if math.isnan(epsilon):
        raise AccountingError("dp-accounting returned no epsilon for the events")
    return max(epsilon, 0.0)


def pld_epsilon(events: Iterable[Event] | Mapping[Event, int], delta: float) -> float:
    """Epsilon at ``delta`` of the events composed with their PLDs (events may be given with
    counts); inf when no epsilon reaches ``delta``."""
    return _pld_figure(_tally(events), delta)


def rdp_epsilon(events: Iterable[Event], delta: float) -> float | None:
    """The same composition by dp-accounting's RDP accountant (looser, a cross-check), or
    None where an event has no RDP form (an approximate-DP event) or ``delta`` is 0."""
    inner = [event.rdp_event() for event in events]
    if not inner or None in inner or _checked_delta(delta) == 0:
        return None
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    accountant = RdpAccountant()
    accountant.compose(_dp_event().ComposedDpEvent(inner))
    return float(accountant.get_epsilon(delta))


def basic_epsilon(charges: Iterable[Charge], delta: float) -> float:
    """The sum of the charges' epsilons when their deltas add up to at most ``delta``, else
    inf: what the ledger charged before events were composed."""
    charges = list(charges)
    if sum(c.delta for c in charges) > _checked_delta(delta) + _TOLERANCE:
        return math.inf
    return float(sum(c.epsilon for c in charges))


def _figure(charges: Mapping[Charge, int], delta: float) -> float:
    events: Counter[Event] = Counter()
    for charge, count in charges.items():
        events[charge.event] += count
    basic = math.inf
    if sum(c.delta * n for c, n in charges.items()) <= _checked_delta(delta) + _TOLERANCE:
        basic = float(sum(c.epsilon * n for c, n in charges.items()))
    return min(basic, _pld_figure(_tally(events), delta))


def composed_epsilon(charges: Iterable[Charge], delta: float) -> float:
    """What the charges have spent, as epsilon at the owner's ``delta``: the smaller of the
    PLD composition and the basic sum (both are upper bounds, so their minimum is one)."""
    return _figure(Counter(charges), delta)


def runs_left(charges: Iterable[Charge], run: Charge, epsilon_total: float, delta: float) -> int:
    """How many more releases like ``run`` fit in ``epsilon_total`` at ``delta`` after
    ``charges`` (the same test the ledger applies to each), at most :data:`MAX_RUNS`."""
    spent = Counter(charges)

    def fits(extra: int) -> bool:
        return _figure(spent + Counter({run: extra}), delta) <= epsilon_total + _TOLERANCE

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_RUNS and fits(high):
        low, high = high, high * 2
    if high > MAX_RUNS:
        if fits(MAX_RUNS):
            return MAX_RUNS
        high = MAX_RUNS
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
