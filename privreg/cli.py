"""``privreg``: what a data owner does outside Prefect.

privreg load SOURCE --database D --table T [--id-column C] [--label-column L] [--label-domain 0,1]
privreg run JOB_FILE                      run the pipeline of a job file locally
privreg budget set --database D --table T --epsilon E [--delta X]
privreg budget show --database D [--table T] [--json]
privreg policy set --database D --table T [--allow-noiseless-release | --no-allow-noiseless-release]
                   [--allow-raw-export | --no-allow-raw-export]
privreg policy show --database D [--table T] [--json]
privreg models list --database D         every flow's saved models in a party's database
privreg models show --database D --key K  one model: coefficients by feature, intercept
privreg models export --database D --key K --out FILE.json
privreg paillier prepare-key --job-id J --guest G --hosts H1,H2 --database ARBITER_DB
                 [--key-holder arbiter] [--key-size 2048]
                                          key holder: a vertical job's key pair, ahead of the run
privreg paillier fill-pool --job-id J --guest G --hosts H1,H2 --database OWN_DB --party P
                 (--count N | --rows R [--batch-size B] [--epochs E]) [--randomizer full]
                                          encrypting party: its obfuscators for that key
privreg certs ... / privreg party ...     a party at its own organisation (privreg/party_cli.py)

Errors print one line and exit with status 1; add --debug for the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from privreg import party_cli
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy, PolicyError


def _domain(text: str | None) -> tuple[float, ...] | None:
    return None if text is None else tuple(float(v) for v in text.split(","))


def _load(args: argparse.Namespace) -> None:
    ref = TableRef(
        database=args.database,
        table=args.table,
        id_column=args.id_column,
        label_column=args.label_column,
        label_domain=_domain(args.label_domain),
        **({"party": args.party} if args.party else {}),
    )
    rows = PartyStore.of(ref).import_file(args.source, ref)
    print(f"{rows} rows loaded into {ref.table} of {ref.database}")
    print(json.dumps(ref.to_dict()))


class _ProgressPrinter(logging.Handler):
    """``privreg run``'s progress: the stage (flow run) starting, round x of y, elapsed time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Beginning subflow run"):
            text = "stage " + message.split("'")[1]
        elif message.startswith("progress: "):
            text = f"{getattr(record, 'flow_run_name', '')}: {message.removeprefix('progress: ')}"
        else:
            return
        print(f"[{time.monotonic() - self.started:7.1f} s] {text}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> None:
    if not Path(args.job_file).is_file():
        raise FileNotFoundError(f"job file {args.job_file} does not exist")
    from flows.pipeline import pipeline

    printer = _ProgressPrinter()
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(printer)
    try:
        pipeline(args.job_file, workspace=args.workspace)
    finally:
        logger.removeHandler(printer)
    print(f"finished in {time.monotonic() - printer.started:.1f} s", file=sys.stderr)


def _text_table(rows: list[dict[str, Any]]) -> str:
    """Rows as aligned columns for a terminal."""
    if not rows:
        return "(none)"
    columns = list(rows[0])
    cells = [[f"{v:g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _budget(args: argparse.Namespace) -> None:
    """The owner's budgets: ``set`` is the only way a budget changes."""
    store = PartyStore(args.database)
    ledger = PrivacyLedger(store)
    if args.action == "set":
        ledger.set_budget(args.table, args.epsilon, args.delta)
    if args.table and not store.has_table(args.table):
        raise PolicyError(f"{args.database} has no table {args.table!r}")
    tables = [ledger.budget_table(args.table)] if args.table else ledger.budgets()
    statuses = [ledger.status(table).as_dict() for table in tables]
    if args.json:
        spends = {t: ledger.spends(t) for t in tables}
        print(json.dumps([{**s, "spends": spends[s["protected_table"]]} for s in statuses],
                         default=str, indent=2))  # fmt: skip
        return
    print(_text_table(statuses))
    for table in tables:
        spends = ledger.spends(table)
        if spends:
            keys = ("created_at", "epsilon", "delta", "mechanism", "job_id")
            print(f"\nspends of {table}:")
            print(_text_table([{k: s[k] for k in keys} for s in spends]))


def _policy(args: argparse.Namespace) -> None:
    """The owner's permissions: everything that gives up privacy is off until set here."""
    store = PartyStore(args.database)
    policy = OwnerPolicy(store)
    if args.action == "set":
        chosen = {k: getattr(args, k) for k in ("allow_noiseless_release", "allow_raw_export")}
        policy.set(args.table, **{k: v for k, v in chosen.items() if v is not None})
    if args.table and not store.has_table(args.table):
        raise PolicyError(f"{args.database} has no table {args.table!r}")
    tables = [args.table] if args.table else PrivacyLedger(store).budgets()
    rows = [policy.get(table).as_dict() for table in tables]
    print(json.dumps(rows, indent=2) if args.json else _text_table(rows))


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _models(args: argparse.Namespace) -> None:
    if not Path(args.database).is_file():
        raise FileNotFoundError(f"database {args.database} does not exist")
    artifacts = ArtifactStore(PartyStore(args.database))
    if args.action == "list":
        models = [
            (k, size, created) for k, kind, size, created in artifacts.list() if kind == "model"
        ]
        if not models:
            print(f"no models in {args.database}")
        for key, size, created in models:
            print(f"{created:%Y-%m-%d %H:%M:%S}  {size:>8} B  {key}")
        return
    model = artifacts.get(args.key)
    if model is None:
        raise KeyError(f"no model {args.key!r} in {args.database} (see privreg models list)")
    if args.action == "show":
        _show_model(args.key, model)
        return
    Path(args.out).write_text(json.dumps(_plain(model), indent=2))
    print(f"wrote {args.out}")


def _show_model(key: str, model: dict[str, Any]) -> None:
    from tasks.reporting import model_table

    rows, intercept = model_table(model)
    print(f"model {key}")
    for field in ("job_id", "round", "rounds", "table", "fingerprint"):
        if model.get(field) is not None:
            print(f"  {field.replace('_', ' ')}: {_plain(model[field])}")
    if intercept is not None:
        print(f"  intercept: {intercept:.6g}")
    width = max((len(r["feature"]) for r in rows), default=7)
    print(f"  {'feature':<{width}}  coefficient")
    for row in rows:
        print(f"  {row['feature']:<{width}}  {row['coefficient']:.6g}")


def _paillier(args: argparse.Namespace) -> None:
    """Work done ahead of a vertical LR run (see tasks/vertical_lr.py for why it is sound)."""
    from tasks import vertical_lr as steps

    job = steps.keys_job(
        args.job_id,
        args.guest,
        tuple(h for h in args.hosts.split(",") if h),
        args.key_holder,
        args.database if args.action == "prepare-key" else "",
        args.workspace,
        args.randomizer,
        key_size=args.key_size,  # fill-pool checks the key holder's n against it
    )
    if args.action == "prepare-key":
        bits = steps.prepare_key(job, args.key_size)
        print(f"job {args.job_id}: {bits}-bit key pair ready; n sent to the other parties")
        return
    ref = TableRef(args.database, "obfuscators", party=args.party or "")
    count = args.count
    if count is None:
        if args.rows is None:
            raise SystemExit("fill-pool needs --count or --rows")
        agreed = steps.agreed_job(job, args.rows, {}, args.batch_size, args.holdout_fraction)
        count = steps.obfuscators_needed(agreed, ref.party, args.epochs)
    started = time.perf_counter()
    held = steps.prepare_pool(job, ref, count)
    print(
        f"{ref.party}: {count} obfuscators computed in {time.perf_counter() - started:.1f} s; "
        f"the pool for job {args.job_id} holds {held}"
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line and status 1, like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(1, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="privreg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    load = commands.add_parser("load", help="validate and import a CSV or Parquet file")
    load.add_argument("source")
    load.add_argument("--database", required=True)
    load.add_argument("--table", required=True)
    load.add_argument("--party")
    load.add_argument("--id-column", default="id")
    load.add_argument("--label-column")
    load.add_argument("--label-domain", help="comma-separated allowed label values")
    load.set_defaults(handler=_load)
    run = commands.add_parser("run", help="run a job file's pipeline locally")
    run.add_argument("job_file")
    run.add_argument("--workspace")
    run.set_defaults(handler=_run)
    budget = commands.add_parser("budget", help="show or set a table's privacy budget")
    budget.add_argument("action", choices=["show", "set"])
    budget.add_argument("--database", required=True)
    budget.add_argument("--table")
    budget.add_argument("--epsilon", type=float)
    budget.add_argument("--delta", type=float, default=0.0)
    budget.add_argument("--json", action="store_true", help="print JSON instead of a table")
    budget.set_defaults(handler=_budget)
    policy = commands.add_parser(
        "policy", help="show or set what a table's owner allows (no-noise releases, raw rows)"
    )
    policy.add_argument("action", choices=["show", "set"])
    policy.add_argument("--database", required=True)
    policy.add_argument("--table")
    for name in ("allow-noiseless-release", "allow-raw-export"):
        policy.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None)
    policy.add_argument("--json", action="store_true", help="print JSON instead of a table")
    policy.set_defaults(handler=_policy)
    models = commands.add_parser("models", help="list, show or export saved models")
    models.add_argument("action", choices=["list", "show", "export"])
    models.add_argument("--database", required=True)
    models.add_argument("--key")
    models.add_argument("--out")
    models.set_defaults(handler=_models)
    paillier = commands.add_parser(
        "paillier", help="prepare a vertical job's key and a party's obfuscators ahead of its run"
    )
    paillier.add_argument("action", choices=["prepare-key", "fill-pool"])
    paillier.add_argument("--job-id", required=True, help="the job id every party agreed on")
    paillier.add_argument("--guest", required=True)
    paillier.add_argument("--hosts", required=True, help="comma-separated, in the job's order")
    paillier.add_argument("--key-holder", default="arbiter")
    paillier.add_argument("--database", required=True, help="this party's own database")
    paillier.add_argument("--party", help="this party's name (default: the database's name)")
    paillier.add_argument("--workspace", help="the shared message folder (embedded runs)")
    paillier.add_argument("--key-size", type=int, default=2048)
    paillier.add_argument("--randomizer", default="full", choices=["full", "short", "standard"])
    paillier.add_argument("--count", type=int, help="obfuscators to add to the pool")
    paillier.add_argument("--rows", type=int, help="or: the job's rows, to compute the count")
    paillier.add_argument("--batch-size", type=int, default=1024)
    paillier.add_argument("--holdout-fraction", type=float, default=0.1)
    paillier.add_argument("--epochs", type=int, default=1)
    paillier.set_defaults(handler=_paillier)
    party_cli.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "budget" and args.action == "set" and (not args.table or not args.epsilon):
        raise SystemExit("budget set needs --table and --epsilon")
    if args.command == "policy" and args.action == "set" and not args.table:
        raise SystemExit("policy set needs --table")
    if args.command == "models" and args.action == "export" and not (args.key and args.out):
        raise SystemExit("models export needs --key and --out")
    if args.command == "models" and args.action == "show" and not args.key:
        print("privreg: error: models show needs --key", file=sys.stderr)
        return 1
    try:
        args.handler(args)
    except Exception as error:
        if args.debug:
            traceback.print_exc()
        print(f"privreg: error: {_one_line(error)}", file=sys.stderr)
        return 1
    return 0


def _one_line(error: BaseException) -> str:
    """The error's message on one line (KeyError's repr quotes dropped), with its kind when the
    message alone would not say what went wrong."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    text = " ".join(str(text).split())
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
