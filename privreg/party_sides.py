"""A standalone party command (``privreg party psi|vertical|horizontal|...``) is one side of
its job in the federation, as a side started by ``privreg party pipeline`` is.

Each command names its job and its peers on the command line; wrapped by :func:`as_side`, it
publishes its state to them and hears theirs (``federation.status``): a peer that fails,
is aborted or is gone past the restart grace ends this side within seconds, naming it, and
this side's own failure (an exception, Ctrl-C, SIGTERM) reaches every peer before it exits.
Hospitals of horizontal LR and sites of sparse LDA are dropouts their protocol survives: their
failure ends nobody's side; the coordinator's does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

COORDINATOR = "coordinator"


@dataclass(frozen=True)
class Side:
    """Who takes part in a standalone command's job, as its arguments say."""

    job: str
    parties: tuple[str, ...]
    tolerated: tuple[str, ...] = ()


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def two_parties(args: argparse.Namespace, party: str) -> Side:
    """PSI, WALR, label DP: this party and its one peer."""
    return Side(args.job, (party, args.peer))


def vertical(args: argparse.Namespace, party: str) -> Side:
    arbiter = () if args.no_arbiter else (args.arbiter,)
    return Side(args.job, (party, args.guest, *_names(args.hosts), *arbiter))


def hospitals(args: argparse.Namespace, party: str) -> Side:
    """Horizontal LR and sparse LDA: the coordinator and the hospitals (sites), who may drop."""
    sites = tuple(_names(args.parties))
    return Side(args.job, (party, COORDINATOR, *sites), tolerated=sites)


def as_side(
    command: Callable[[argparse.Namespace], None],
    side: Callable[[argparse.Namespace, str], Side],
) -> Callable[[argparse.Namespace], None]:
    """``command`` run as this party's side of the job ``side`` describes."""

    def run(args: argparse.Namespace) -> None:
        from federation.party_config import PartyConfig
        from federation.status import Federation
        from federation.transport_grpc import transport_for

        config = PartyConfig.load(args.config)
        taking_part = side(args, config.party)
        federation = Federation(
            transport_for(config), taking_part.job, config.party, taking_part.parties,
            tolerated=tuple(p for p in taking_part.tolerated if p != config.party),
        )  # fmt: skip
        with federation.taking_part():
            command(args)

    run.__doc__ = command.__doc__
    return run
