"""``privreg certs`` and ``privreg party``: what one organisation runs to join over the network.

privreg certs init --out DIR                      a demo CA (DIR/ca.pem, DIR/ca.key)
privreg certs issue --ca DIR --party NAME --out DIR
privreg party serve --config party.toml [--flows] its message endpoint (mTLS gRPC) [and flows]
privreg party psi --config party.toml --table DESCRIPTOR --peer NAME --job JOB [--min-rows N]
    [--protocol kkrt|ecdh | --count-only]     (count only: the size of the intersection, no rows)
privreg party walr --config party.toml --table DESCRIPTOR --role labels|features --peer NAME
    --job JOB --epsilon E --delta D [--mode M --clip-norm C ...]   (both: the same options)
privreg party label-dp --config party.toml --table DESCRIPTOR --role labels|features
    --peer NAME --job JOB [--epsilon E --label-range LOW HIGH ...] (labels party: the options)
privreg party horizontal --config party.toml --job JOB --parties A,B,C [--table DESCRIPTOR]
privreg party vertical --config party.toml --job JOB --role ROLE --guest NAME --hosts A,B
    [--table DESCRIPTOR] [--arbiter NAME | --no-arbiter] [--options JSON]
privreg party sparse-lda --config party.toml --job JOB --parties A,B,C [--table DESCRIPTOR]
    --options JSON      (a site gives its own table, the coordinator none; the same options)
privreg party pipeline --config party.toml --job-file JOB.json [--run RUN]
    this party's stages of a whole job file (the same file at every organisation)

A command under ``party`` runs as the configured party only: its channel is its own folder and
the network, and it is given no other party's path. Each protocol command runs as this party's
side of its job (``privreg/party_sides.py``): its peers hear its state and its failure, and it
ends within seconds when one of them fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from privreg import party_sides as sides
from privreg.party_sides import as_side


def _certs(args: argparse.Namespace) -> None:
    from federation import certs

    if args.action == "init":
        issued = certs.create_ca(args.out, name=args.name)
    else:
        if not args.party:
            raise SystemExit("certs issue needs --party")
        ca_dir = Path(args.ca)
        issued = certs.issue(
            certs.Issued(ca_dir / "ca.pem", ca_dir / "ca.key"), args.party, args.out
        )
    print(f"certificate {issued.cert}\nprivate key {issued.key} (mode 0600)")


def _as_party(config_path: str) -> Any:
    """Load the configuration and make this whole process that party (read by channel_for)."""
    from federation.party_config import ENV_VAR, PartyConfig

    config = PartyConfig.load(config_path)
    os.environ[ENV_VAR] = str(Path(config_path).resolve())
    # SIGTERM ends a side the way Ctrl-C does: its peers are told why before it exits
    signal.signal(signal.SIGTERM, _interrupted)
    return config


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _serve(args: argparse.Namespace) -> None:
    """The endpoint checks itself first (one line and exit 1 for the first check that fails),
    then prints what it serves as; refused callers and renewals are logged on stderr."""
    import logging
    import sys

    from federation.identity import EXPIRY_WARNING_DAYS, IdentityError, check_own
    from federation.transport_grpc import serve
    from privreg.party_service import PartyService

    config = _as_party(args.config)
    try:
        own = check_own(config.party, config.ca, config.cert, config.key)
    except IdentityError as error:
        raise IdentityError(f"refusing to serve: {error}") from None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("privreg.endpoint").addHandler(handler)
    service = PartyService(config, Path(args.config))  # proposals start this party's sides
    server, port = serve(config, on_proposal=service)
    host = config.listen.rsplit(":", 1)[0]
    print(f"party {config.party} serving its messages on {host}:{port}; {own.summary()}")
    if own.days_left() < EXPIRY_WARNING_DAYS:
        print(
            f"WARNING: party {config.party}'s certificate expires in {own.days_left():.0f} days;"
            " renew it (same CA, same name): the endpoint picks it up without a restart",
            file=sys.stderr,
        )
    sys.stdout.flush()
    try:
        if args.flows:
            _serve_flows(config.party)
        else:
            stop = threading.Event()
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
            stop.wait()
    finally:
        service.stop()
        server.stop(grace=2).wait()


def _serve_flows(party: str) -> None:
    """Serve this party's role-split flows from this process, on the party's own Prefect.

    Runs are started from that Prefect (UI, API or ``prefect deployment run``); they execute
    code this party installed, in a child of this process, as this party (its configuration
    is in the environment). No work pool job template is involved.
    """
    from prefect import serve

    from flows.align import psi_align_party
    from flows.horizontal_lr import horizontal_lr_coordinator, horizontal_lr_party
    from flows.job_start import start_job
    from flows.label_dp import label_dp_party
    from flows.pipeline_party import pipeline_party
    from flows.psi_count import psi_count_party
    from flows.sparse_lda import sparse_lda_coordinator, sparse_lda_party
    from flows.vertical_party import vertical_lr_party
    from flows.walr import walr_party

    flows = [
        psi_align_party,
        psi_count_party,
        vertical_lr_party,
        walr_party,
        label_dp_party,
        horizontal_lr_party,
        horizontal_lr_coordinator,
        sparse_lda_party,
        sparse_lda_coordinator,
        pipeline_party,
        start_job,  # a run of this party's: proposes it to every peer (schedule it in the UI)
    ]
    serve(*(f.to_deployment(name=party, tags=["privreg", party]) for f in flows))


def _descriptor(text: str) -> dict[str, Any]:
    """Inline JSON, or the path of a file holding it. An object is never looked up as a path:
    one longer than a file name may be (255 bytes) made the lookup fail."""
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if path.exists():
            return json.loads(path.read_text())
    return json.loads(text)


def _psi(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    own = _own_table(config, args.table)
    if args.count_only:  # KKRT16's receiver learns its matching rows: PSI-CA runs instead
        from flows.psi_count import psi_count_party

        print(json.dumps(psi_count_party(own, args.peer, args.job, min_rows=args.min_rows)))
        return
    from flows.align import psi_align_party

    result = psi_align_party(
        own, args.peer, args.job, min_rows=args.min_rows, protocol=args.protocol
    )
    print(json.dumps(result))


def _own_table(config: Any, text: str) -> dict[str, Any]:
    """The descriptor of this party's own table; another party's table is refused."""
    return config.own_table(_descriptor(text))


def _walr(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    own = _own_table(config, args.table)
    from flows.walr import walr_party

    result = walr_party(own, args.role, args.peer, args.job, **_options(args, walr_party))
    print(json.dumps(result))


def _label_dp(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    own = _own_table(config, args.table)
    from flows.label_dp import label_dp_party

    result = label_dp_party(own, args.role, args.peer, args.job, **_options(args, label_dp_party))
    print(json.dumps(result))


def _options(args: argparse.Namespace, flow: Any) -> dict[str, Any]:
    """The flow's options given on the command line; the flow's defaults fill the rest."""
    import inspect

    names = set(inspect.signature(flow.fn).parameters) - {"own", "role", "peer", "job_id"}
    return {k: v for k, v in vars(args).items() if k in names}


CONFIG_HELP = "this party's party.toml"
FLOW_DEFAULT = "default: the flow's"


def _one_release_parser(actions: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    """The arguments every one-release party command shares (WALR, label DP); options left
    out take the flow's defaults."""
    parser = actions.add_parser(name, help=help_text, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", required=True, help=CONFIG_HELP)
    parser.add_argument("--table", required=True, help="own table descriptor (JSON or file)")
    parser.add_argument(
        "--role", required=True, choices=["labels", "features"], help="this party's side"
    )
    parser.add_argument("--peer", required=True, help="the other party's name")
    parser.add_argument("--job", required=True, help="the job id both parties agreed on")
    parser.add_argument("--evaluate", action="store_true", help="both parties must pass it")
    return parser


def _horizontal(args: argparse.Namespace) -> None:
    """A hospital's side of horizontal LR, or the coordinator's if this party is it."""
    config = _as_party(args.config)
    from flows.horizontal_lr import COORDINATOR, horizontal_lr_coordinator, horizontal_lr_party

    parties = [p.strip() for p in args.parties.split(",") if p.strip()]
    shared = {"local_epochs": args.local_epochs, "learning_rate": args.learning_rate, "l2": args.l2}
    if config.party == COORDINATOR:
        result = horizontal_lr_coordinator(
            parties,
            args.job,
            rounds=args.rounds,
            tol=args.tol,
            threshold=args.threshold,
            stage_timeout=args.stage_timeout,
            join_timeout=args.join_timeout,
            **shared,
        )
    else:
        if not args.table:
            raise SystemExit(f"party {config.party!r} needs --table (its own table descriptor)")
        own = _own_table(config, args.table)
        result = horizontal_lr_party(
            own, parties, args.job, holdout_fraction=args.holdout_fraction,
            threshold=args.threshold, stage_timeout=args.stage_timeout, **shared,
        )  # fmt: skip
    print(json.dumps(result, default=float))


def _vertical(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    own = _own_table(config, args.table) if args.table else None
    arbiter = None if args.no_arbiter else args.arbiter
    if args.role == "arbiter" and arbiter != config.party:
        raise SystemExit(f"this process is {config.party!r}, not the arbiter {arbiter!r}")
    from flows.vertical_party import vertical_lr_party

    result = vertical_lr_party(
        args.role,
        args.job,
        args.guest,
        [h for h in args.hosts.split(",") if h],
        own=own,
        arbiter=arbiter,
        **(_descriptor(args.options) if args.options else {}),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


def _pipeline(args: argparse.Namespace) -> None:
    """This party's stages of a job file; one line per stage, then the result as JSON."""
    config = _as_party(args.config)
    from dataclasses import asdict

    from flows.pipeline_party import pipeline_party

    job_file, folder = Path(args.job_file).resolve(), Path(args.config).resolve().parent
    if job_file.is_relative_to(folder):  # the flow reads relative paths from the party's folder
        job_file = job_file.relative_to(folder)
    result = pipeline_party(str(job_file), args.run, proposed_by=args.proposed_by)
    for stage in result.stages:
        print(stage.line(config.party), flush=True)
    print(json.dumps(asdict(result), default=float))


def _sparse_lda(args: argparse.Namespace) -> None:
    """A site's side of sparse LDA (its own table), or the coordinator's (no table)."""
    import inspect

    config = _as_party(args.config)
    from flows.sparse_lda import COORDINATOR, sparse_lda_coordinator, sparse_lda_party

    parties = [p.strip() for p in args.parties.split(",") if p.strip()]
    options = _descriptor(args.options) if args.options else {}
    takes = {  # one options file for every party: each takes the options of its role
        f: set(inspect.signature(f.fn).parameters) - {"own", "parties", "job_id"}
        for f in (sparse_lda_coordinator, sparse_lda_party)
    }
    if unknown := sorted(set(options) - takes[sparse_lda_coordinator] - takes[sparse_lda_party]):
        raise SystemExit(f"unknown sparse LDA options {unknown}")
    if config.party == COORDINATOR:
        if args.table:
            raise SystemExit("the coordinator holds no table; leave out --table")
        mine = {k: v for k, v in options.items() if k in takes[sparse_lda_coordinator]}
        result = sparse_lda_coordinator(parties, args.job, **mine)
    else:
        if not args.table:
            raise SystemExit(f"party {config.party!r} needs --table (its own table descriptor)")
        own = _own_table(config, args.table)
        mine = {k: v for k, v in options.items() if k in takes[sparse_lda_party]}
        result = sparse_lda_party(own, parties, args.job, **mine)
    print(json.dumps(result, default=float))


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``certs`` and ``party`` to the ``privreg`` command."""
    certs = commands.add_parser("certs", help="a demo CA and per-party certificates")
    certs.add_argument("action", choices=["init", "issue"], help="init a CA, or issue a party's")
    certs.add_argument("--out", required=True, help="folder for the files")
    certs.add_argument("--ca", default=".", help="folder holding ca.pem and ca.key (issue)")
    certs.add_argument("--party", help="the party's name, as in its configuration (issue)")
    certs.add_argument("--name", default="privreg demo CA", help="the CA's name (init)")
    certs.set_defaults(handler=_certs)
    party = commands.add_parser("party", help="run as one party of a multi-organisation job")
    actions = party.add_subparsers(dest="party_command", required=True)
    serve = actions.add_parser("serve", help="serve this party's message endpoint")
    serve.add_argument("--config", required=True, help=CONFIG_HELP)
    serve.add_argument(
        "--flows", action="store_true", help="also serve the party's flows on its own Prefect"
    )
    serve.set_defaults(handler=_serve)
    psi = actions.add_parser("psi", help="this party's side of psi_align")
    psi.add_argument("--config", required=True, help=CONFIG_HELP)
    psi.add_argument("--table", required=True, help="own table descriptor (JSON or file)")
    psi.add_argument("--peer", required=True, help="the other party's name")
    psi.add_argument("--job", required=True, help="the job id both parties agreed on")
    psi.add_argument("--min-rows", type=int, default=100, help="smallest intersection accepted")
    psi.add_argument(
        "--protocol", choices=["kkrt", "ecdh"], default="kkrt", help="both parties pass the same"
    )
    psi.add_argument(
        "--count-only",
        action="store_true",
        help="learn only how many ids are shared (psi_count: shuffled ECDH PSI-CA, whatever "
        "--protocol says; no table is written); both parties pass it",
    )
    psi.set_defaults(handler=as_side(_psi, sides.two_parties))
    walr = _one_release_parser(actions, "walr", "this party's side of walr")
    walr.add_argument("--epsilon", type=float, required=True, help="of the one release, > 0")
    walr.add_argument("--delta", type=float, required=True, help="of the one release, (0, 1)")
    walr.add_argument("--mode", choices=["clipped", "binary"], help=FLOW_DEFAULT)
    walr.add_argument("--clip-norm", type=float, help="row norm bound, clipped mode")
    walr.add_argument("--l2", type=float, help=f"ridge penalty; {FLOW_DEFAULT}")
    walr.add_argument("--key-size", type=int, help=f"Paillier bits; {FLOW_DEFAULT}")
    walr.add_argument("--protected-table", help="the labels table or its source (labels)")
    walr.add_argument("--randomizer", help="Paillier obfuscators: full, short or standard")
    walr.add_argument("--holdout-fraction", type=float, help="both parties must pass the same")
    walr.set_defaults(handler=as_side(_walr, sides.two_parties))
    label_dp = _one_release_parser(actions, "label-dp", "this party's side of label DP")
    label_dp.add_argument("--epsilon", type=float, help="the labels party's (required there)")
    label_dp.add_argument("--loss", help=f"squared, absolute or poisson; {FLOW_DEFAULT}")
    label_dp.add_argument(
        "--label-range", type=float, nargs=2, metavar=("LOW", "HIGH"), help="labels clipped to"
    )
    label_dp.add_argument("--mechanism", help=f"release mechanism; {FLOW_DEFAULT}")
    label_dp.add_argument("--prior-epsilon", type=float, help="epsilon share of the prior")
    label_dp.add_argument("--grid-size", type=int, help=f"label grid points; {FLOW_DEFAULT}")
    label_dp.add_argument("--integer-labels", action="store_true", help="whole-number labels")
    label_dp.add_argument(
        "--no-clip", dest="clip", action="store_false", help="do not clip to the label range"
    )
    label_dp.add_argument("--holdout-fraction", type=float, help=f"rows held out; {FLOW_DEFAULT}")
    label_dp.add_argument("--seed", type=int, help=f"seeds the hold-out; {FLOW_DEFAULT}")
    label_dp.set_defaults(handler=as_side(_label_dp, sides.two_parties))
    hlr = actions.add_parser("horizontal", help="a hospital's or the coordinator's side")
    hlr.add_argument("--config", required=True, help=CONFIG_HELP)
    hlr.add_argument("--job", required=True, help="the job id every party agreed on")
    hlr.add_argument("--parties", required=True, help="the hospitals, comma-separated")
    hlr.add_argument("--table", help="own table descriptor (JSON or file; hospitals)")
    hlr.add_argument("--rounds", type=int, default=20, help="most rounds (coordinator)")
    hlr.add_argument("--local-epochs", type=int, default=0, help="local passes per round")
    hlr.add_argument("--learning-rate", type=float, default=0.2, help="step size")
    hlr.add_argument("--l2", type=float, default=1e-3, help="ridge penalty")
    hlr.add_argument("--tol", type=float, default=1e-6, help="stop below this (coordinator)")
    hlr.add_argument("--threshold", type=int, help="parties needed at every stage (agreed)")
    hlr.add_argument(
        "--stage-timeout",
        type=float,
        default=60.0,
        help="seconds each secure-sum stage waits before a silent hospital counts as dropped; "
        "later rounds leave it out until it asks to rejoin (coordinator)",
    )
    hlr.add_argument(
        "--join-timeout",
        type=float,
        default=600.0,
        help="seconds to wait at start for the hospitals' columns; the missing ones are named "
        "in the log every 5 s (coordinator)",
    )
    hlr.add_argument("--holdout-fraction", type=float, default=0.0, help="own rows (hospitals)")
    hlr.set_defaults(handler=as_side(_horizontal, sides.hospitals))
    vertical = actions.add_parser("vertical", help="this party's side of vertical_lr")
    vertical.add_argument("--config", required=True, help=CONFIG_HELP)
    vertical.add_argument("--job", required=True, help="the job id every party agreed on")
    vertical.add_argument(
        "--role", required=True, choices=["guest", "host", "arbiter"], help="this party's side"
    )
    vertical.add_argument("--guest", required=True, help="the guest's party name")
    vertical.add_argument("--hosts", required=True, help="the hosts' names, comma-separated")
    vertical.add_argument("--table", help="own table descriptor (JSON or file; not the arbiter)")
    vertical.add_argument("--arbiter", default="arbiter", help="the arbiter's party name")
    vertical.add_argument("--no-arbiter", action="store_true", help="two-party mode")
    vertical.add_argument("--options", help="shared training options (JSON or file)")
    vertical.set_defaults(handler=as_side(_vertical, sides.vertical))
    pipeline = actions.add_parser("pipeline", help="this party's stages of a whole job file")
    pipeline.add_argument("--config", required=True, help=CONFIG_HELP)
    pipeline.add_argument("--job-file", required=True, help="the job file every party holds")
    pipeline.add_argument("--run", default="", help="job-id suffix of a scheduled re-run")
    pipeline.add_argument(
        "--proposed-by", default="", help="the peer that proposed this run (set by the service)"
    )
    pipeline.set_defaults(handler=_pipeline)
    lda = actions.add_parser("sparse-lda", help="a site's or the coordinator's side")
    lda.add_argument("--config", required=True, help=CONFIG_HELP)
    lda.add_argument("--job", required=True, help="the job id every party agreed on")
    lda.add_argument("--parties", required=True, help="the sites, comma-separated")
    lda.add_argument("--table", help="own table descriptor (JSON or file; sites)")
    lda.add_argument(
        "--options",
        help="the job's options, alike everywhere (JSON or file); its timeouts: stage_timeout "
        "(default 60 s: each secure-sum stage waits this long before a silent site counts as "
        "dropped) and join_timeout (default 600 s: the coordinator's wait for the sites' "
        "columns at start, naming the missing ones in the log every 5 s)",
    )
    lda.set_defaults(handler=as_side(_sparse_lda, sides.hospitals))
