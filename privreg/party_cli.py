"""``privreg certs`` and ``privreg party``: what one organisation runs to join over the network.

privreg certs init --out DIR                      a demo CA (DIR/ca.pem, DIR/ca.key)
privreg certs issue --ca DIR --party NAME --out DIR
privreg party serve --config party.toml [--flows] its message endpoint (mTLS gRPC) [and flows]
privreg party psi|walr|label-dp --config party.toml --table DESCRIPTOR --peer NAME --job JOB
    [--role labels|features] [OPTIONS]          (both parties: the same options)
privreg party vertical --config party.toml --job JOB --role ROLE --guest NAME --hosts A,B
    [--table DESCRIPTOR] [--arbiter NAME | --no-arbiter] [OPTIONS]
privreg party horizontal|sparse-lda --config party.toml --job JOB --parties A,B,C
    [--table DESCRIPTOR] [OPTIONS]   (a hospital gives its own table, the coordinator none)
privreg party pipeline --config party.toml --job-file JOB.json [--run RUN]
    this party's stages of a whole job file (the same file at every organisation)

OPTIONS are the stage's options (``core/job_schema.py``): ``--options JSON`` (or a JSON file)
and one flag per option (``--clip-norm 2``), validated by the model a job file's stage is;
``privreg party psi --count-only`` learns only how many ids are shared.

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
import sys
import threading
from pathlib import Path
from typing import Any

from privreg import party_sides as sides
from privreg.option_flags import defer_option_flags, json_value, options_from, validated
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


def _as_side(config_path: str) -> Any:
    """:func:`_as_party` for a side started by hand: it reports to the organisation's Prefect
    server (the one ``party serve`` hosts) when that answers, as the service's sides do."""
    from privreg.org_prefect import side_prefect

    config = _as_party(config_path)
    side_prefect(config, lambda line: print(line, file=sys.stderr, flush=True))
    return config


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _serve(args: argparse.Namespace) -> None:
    """The endpoint checks itself first (one line and exit 1 for the first check that fails),
    then prints what it serves as (the first line, which scripts wait for), then hosts the
    organisation's Prefect server (``privreg.org_prefect``: it waits for it, saying since when,
    and prints its UI's URL); refused callers and renewals are logged on stderr."""
    import logging
    import sys

    from federation.identity import EXPIRY_WARNING_DAYS, IdentityError, check_own
    from federation.transport_grpc import serve
    from privreg.org_prefect import OrgPrefect
    from privreg.party_service import PartyService

    config = _as_party(args.config)
    try:
        own = check_own(config.party, config.ca, config.cert, config.key)
    except IdentityError as error:
        raise IdentityError(f"refusing to serve: {error}") from None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("privreg.endpoint").addHandler(handler)
    prefect = OrgPrefect.for_party(config)  # the organisation's server: given, or started
    try:
        service = PartyService(config, Path(args.config), prefect)  # proposals start sides
        server, port = serve(config, on_proposal=service)
    except BaseException:
        prefect.stop()
        raise
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
        try:
            prefect.wait_ready(lambda line: print(line, flush=True))
        except KeyboardInterrupt:  # SIGTERM or Ctrl-C while it starts: a quiet stop
            raise SystemExit(f"party {config.party} stopped before its Prefect answered") from None
        os.environ["PREFECT_API_URL"] = prefect.api_url  # --flows serves on it too
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
        prefect.stop()  # after the sides that report to it


def _serve_flows(party: str) -> None:
    """Serve this party's role-split flows from this process, on the organisation's Prefect.

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


def _psi(args: argparse.Namespace) -> None:
    config = _as_side(args.config)
    own = _own_table(config, args.table)
    options = options_from(args, _model("PsiOptions"))
    if args.count_only:  # KKRT16's receiver learns its matching rows: PSI-CA runs instead
        from flows.psi_count import psi_count_party

        print(json.dumps(psi_count_party(own, args.peer, args.job, min_rows=options.min_rows)))
        return
    from flows.align import psi_align_party

    print(json.dumps(psi_align_party(own, args.peer, args.job, options)))


def _own_table(config: Any, text: str) -> dict[str, Any]:
    """The descriptor of this party's own table; another party's table is refused."""
    return config.own_table(json_value(text))


def _walr(args: argparse.Namespace) -> None:
    config = _as_side(args.config)
    own, options = _own_table(config, args.table), options_from(args, _model("WalrOptions"))
    from flows.walr import walr_party

    result = walr_party(own, args.role, args.peer, args.job, options, _preprocessing(args))
    print(json.dumps(result))


def _label_dp(args: argparse.Namespace) -> None:
    config = _as_side(args.config)
    own, options = _own_table(config, args.table), options_from(args, _model("LabelDPOptions"))
    from flows.label_dp import label_dp_party

    result = label_dp_party(own, args.role, args.peer, args.job, options, _preprocessing(args))
    print(json.dumps(result))


CONFIG_HELP = "this party's party.toml"


def _preprocessing(args: argparse.Namespace) -> dict[str, Any] | None:
    """The job's ``--preprocessing`` (JSON or a file), validated as a job file's is; every
    party passes the same (each applies it to its own columns)."""
    if not args.preprocessing:
        return None
    from core.job_schema import Preprocessing

    given = json_value(args.preprocessing)
    return validated(Preprocessing, given, "--preprocessing").model_dump()


PREPROCESSING_HELP = (
    "the job's preprocessing as JSON or a JSON file (scaling, impute, fill_value, "
    "missing_indicator, missing_values, categorical); every party passes the same"
)


def _model(name: str) -> Any:
    """A stage's options model (imported when a command runs, not to build the parser)."""
    from core import job_schema

    return getattr(job_schema, name)


def _two_party_parser(
    actions: Any, name: str, help_text: str, roles: tuple[str, ...] | None, model: str
) -> argparse.ArgumentParser:
    """A side of a two-party protocol (PSI, WALR, label DP): this party's table, its peer, the
    agreed job, and the stage's options (both parties pass the same)."""
    parser = actions.add_parser(name, help=help_text)
    parser.add_argument("--config", required=True, help=CONFIG_HELP)
    parser.add_argument("--table", required=True, help="own table descriptor (JSON or file)")
    if roles:
        parser.add_argument("--role", required=True, choices=roles, help="this party's side")
        parser.add_argument("--preprocessing", help=PREPROCESSING_HELP)
    parser.add_argument("--peer", required=True, help="the other party's name")
    parser.add_argument("--job", required=True, help="the job id both parties agreed on")
    defer_option_flags(parser, model)
    return parser


def _hospitals_side(args: argparse.Namespace, model: str, party_flow: str) -> None:
    """A hospital's side (its own table) of a protocol with a coordinator, or the
    coordinator's (no table), with the job's options (alike everywhere)."""
    config = _as_side(args.config)
    import importlib

    flows = importlib.import_module(f"flows.{party_flow}")
    parties = [p.strip() for p in args.parties.split(",") if p.strip()]
    options = options_from(args, _model(model))
    if config.party == sides.COORDINATOR:
        if args.table:
            raise SystemExit("the coordinator holds no table; leave out --table")
        coordinator = getattr(flows, f"{party_flow}_coordinator")
        result = coordinator(parties, args.job, options, _preprocessing(args))
    else:
        if not args.table:
            raise SystemExit(f"party {config.party!r} needs --table (its own table descriptor)")
        own = _own_table(config, args.table)
        side = getattr(flows, f"{party_flow}_party")
        result = side(own, parties, args.job, options, _preprocessing(args))
    print(json.dumps(result, default=float))


def _vertical(args: argparse.Namespace) -> None:
    config = _as_side(args.config)
    own = _own_table(config, args.table) if args.table else None
    options = options_from(args, _model("VerticalOptions"), skip=("arbiter",))  # a name here
    if args.no_arbiter:
        options = options.model_copy(update={"arbiter": False})
    if args.role == "arbiter" and args.arbiter != config.party:
        raise SystemExit(f"this process is {config.party!r}, not the arbiter {args.arbiter!r}")
    from flows.vertical_party import vertical_lr_party

    hosts = [h for h in args.hosts.split(",") if h]
    result = vertical_lr_party(
        args.role,
        args.job,
        args.guest,
        hosts,
        options,
        own=own,
        arbiter=args.arbiter,
        preprocessing=_preprocessing(args),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


def _pipeline(args: argparse.Namespace) -> None:
    """This party's stages of a job file; one line per stage, then the result as JSON."""
    config = _as_side(args.config)
    from dataclasses import asdict

    from flows.pipeline_party import pipeline_party

    job_file, folder = Path(args.job_file).resolve(), Path(args.config).resolve().parent
    if job_file.is_relative_to(folder):  # the flow reads relative paths from the party's folder
        job_file = job_file.relative_to(folder)
    result = pipeline_party(str(job_file), args.run, proposed_by=args.proposed_by)
    for stage in result.stages:
        print(stage.line(config.party), flush=True)
    print(json.dumps(asdict(result), default=float))


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
    psi = _two_party_parser(actions, "psi", "this party's side of psi_align", None, "PsiOptions")
    psi.add_argument(
        "--count-only",
        action="store_true",
        help="learn only how many ids are shared (psi_count: shuffled ECDH PSI-CA, whatever "
        "--protocol says; no table is written); both parties pass it",
    )
    psi.set_defaults(handler=as_side(_psi, sides.two_parties))
    roles = ("labels", "features")
    walr = _two_party_parser(actions, "walr", "this party's side of walr", roles, "WalrOptions")
    walr.set_defaults(handler=as_side(_walr, sides.two_parties))
    label_dp = _two_party_parser(
        actions, "label-dp", "this party's side of label DP", roles, "LabelDPOptions"
    )
    label_dp.set_defaults(handler=as_side(_label_dp, sides.two_parties))
    for name, model, party_flow in (
        ("horizontal", "HorizontalOptions", "horizontal_lr"),
        ("sparse-lda", "SparseLDAOptions", "sparse_lda"),
    ):
        hospitals = actions.add_parser(name, help="a hospital's or the coordinator's side")
        hospitals.add_argument("--config", required=True, help=CONFIG_HELP)
        hospitals.add_argument("--job", required=True, help="the job id every party agreed on")
        hospitals.add_argument("--parties", required=True, help="the hospitals, comma-separated")
        hospitals.add_argument("--table", help="own table descriptor (JSON or file; hospitals)")
        hospitals.add_argument("--preprocessing", help=PREPROCESSING_HELP)
        defer_option_flags(hospitals, model)
        hospitals.set_defaults(
            handler=as_side(
                lambda args, m=model, f=party_flow: _hospitals_side(args, m, f), sides.hospitals
            )
        )
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
    vertical.add_argument("--preprocessing", help=PREPROCESSING_HELP)
    defer_option_flags(vertical, "VerticalOptions", skip=("arbiter",))
    vertical.set_defaults(handler=as_side(_vertical, sides.vertical))
    pipeline = actions.add_parser("pipeline", help="this party's stages of a whole job file")
    pipeline.add_argument("--config", required=True, help=CONFIG_HELP)
    pipeline.add_argument("--job-file", required=True, help="the job file every party holds")
    pipeline.add_argument("--run", default="", help="job-id suffix of a scheduled re-run")
    pipeline.add_argument(
        "--proposed-by", default="", help="the peer that proposed this run (set by the service)"
    )
    pipeline.set_defaults(handler=_pipeline)
