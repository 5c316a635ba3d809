"""``privreg``: what a data owner does outside Prefect.

privreg load SOURCE --database D --table T [--id-column C] [--label-column L] [--label-domain 0,1]
             [--replace | --append]       an existing table: replace it, or append the rows
privreg run JOB_FILE [--run R] [--log-dir var/logs]
                                          run a job file here, every party's side (main job, or
                                          a sub-job alone): progress lines; Prefect's log lines
                                          go to the log; --run R starts a new run of the job
privreg job check JOB_FILE                validate a job file and its sub-jobs; print it with
                                          every default filled in
privreg job schema --markdown             the job-file reference (docs/reference/job-file.md)
privreg budget set --database D --table T --epsilon E [--delta X]
privreg budget show --database D [--table T] [--json]
privreg budget window --database D --table T (--epsilon E [--per-consumer C] [--hours H] | --off)
privreg policy set --database D --table T [--allow-noiseless-release | --no-allow-noiseless-release]
                   [--allow-raw-export | --no-allow-raw-export]
privreg policy show --database D [--table T] [--json]
privreg models list --database D         every flow's saved models in a party's database
privreg models show --database D --key K  one model: coefficients by feature, intercept
privreg models export --database D --key K --out FILE.json   the model in the common format
privreg models promote --database D --key K [--job J]  the model scoring uses for job J
privreg score --database D --table T [--source FILE] (--model K | --job J [--flow F])
                                          new rows scored with a saved model into <table>_scored
privreg paillier prepare-key --job-id J --guest G --hosts H1,H2 --database ARBITER_DB
                 [--key-holder arbiter] [--key-size 2048]
                                          key holder: a vertical job's key pair, ahead of the run
privreg paillier fill-pool --job-id J --guest G --hosts H1,H2 --database OWN_DB --party P
                 (--count N | --rows R [--batch-size B] [--epochs E]) [--randomizer full]
                                          encrypting party: its obfuscators for that key
privreg certs ... / privreg party ...     a party at its own organisation (privreg/party_cli.py)
privreg demo [--dir privreg-demo] [--job SUB_JOB]
                                          the bundled demo, written into a folder and run there

Errors print one line and exit with status 1; add --debug for the traceback.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privreg import bundled, demo_cli, job_check, job_cli, party_cli, score_cli
from privreg.run_log import RunFailedError, flow_command, log_path, one_line

if TYPE_CHECKING:  # a command imports the stores it uses: `privreg --help` loads none of them
    from core.model_format import ModelRecord
    from storage.party_store import PartyStore


def _domain(text: str | None) -> tuple[float, ...] | None:
    return None if text is None else tuple(float(v) for v in text.split(","))


def _load(args: argparse.Namespace) -> None:
    from storage.descriptor import TableRef
    from storage.party_store import PartyStore

    ref = TableRef(
        database=args.database,
        table=args.table,
        id_column=args.id_column,
        label_column=args.label_column,
        label_domain=_domain(args.label_domain),
        **({"party": args.party} if args.party else {}),
    )
    store = PartyStore.of(ref)
    before = store.row_count(ref.table) if args.replace or args.append else None
    if_exists = "append" if args.append else "replace" if args.replace else "fail"
    rows = store.import_file(args.source, ref, if_exists=if_exists)
    if before is None:
        print(f"{rows} rows loaded into {ref.table} of {ref.database}")
    elif args.append:
        print(f"appended {rows - before} rows to {ref.table}: {before} rows -> {rows} rows")
    else:
        print(f"replaced {ref.table}: {before} rows -> {rows} rows")
    print(json.dumps(ref.to_dict()))


def _run(args: argparse.Namespace) -> None:
    """Validate the job file (and its sub-jobs) in full, then run it with Prefect's log lines
    in a file: the terminal shows progress and, on an error, one line and where the log is."""
    from core.job_files import load_job, load_job_tree, read_job  # refused before Prefect
    from core.job_schema import job_kind

    path = Path(args.job_file)
    if not path.is_file():
        raise FileNotFoundError(f"job file {args.job_file} does not exist")
    kind = job_kind(read_job(path))
    if kind == "main":
        load_job_tree(path)
    else:
        print(_sub_job_line(path, kind), file=sys.stderr)
    name = load_job(path).job or path.stem
    log = log_path(args.log_dir, name)
    with flow_command(log, f"privreg run {args.job_file}") as printer:
        from flows.pipeline import pipeline  # Prefect only for a command that runs a flow

        pipeline(args.job_file, workspace=args.workspace, run=args.run)
    print(f"finished in {time.monotonic() - printer.started:.1f} s (log: {log})", file=sys.stderr)


def _sub_job_line(path: Path, kind: str) -> str:
    """Says that ``path`` is a sub-job and which main job files beside it name it."""
    parents = []
    for other in sorted(path.resolve().parent.glob("*.json")):
        try:
            subjobs = json.loads(other.read_text()).get("subjobs") or {}
        except (ValueError, AttributeError):
            continue
        if any(Path(p).name == path.name for p in subjobs.values() if isinstance(p, str)):
            parents.append(other.name)
    named = f" (named in {', '.join(parents)})" if parents else ""
    return f"{path} is a {kind} sub-job{named}: running it on its own"


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


def _existing_store(database: str) -> PartyStore:
    """A party's store that must exist already: a misspelt path is an error, not "(none)"."""
    from storage.party_store import PartyStore

    if not Path(database).is_file():
        raise FileNotFoundError(f"database {database} does not exist")
    return PartyStore(database)


def _budget(args: argparse.Namespace) -> None:
    """The owner's budgets: ``set`` is the only way a total changes, ``window`` the only way
    the owner's window rule does (a party's policy adds its own, see storage.ledger). ``show``
    gives each table's events, their composed epsilon at the owner's delta, what is left and,
    per job, how many more runs of its latest release fit."""
    from storage.ledger import PrivacyLedger, WindowRule
    from storage.policy import PolicyError

    store = _existing_store(args.database)
    ledger = PrivacyLedger(store)
    if args.action == "set":
        ledger.set_budget(args.table, args.epsilon, args.delta)
    if args.action == "window":
        if not args.table:
            raise ValueError("budget window needs --table")
        rule = None if args.off else WindowRule(args.epsilon, args.per_consumer, args.hours * 3600)
        ledger.set_window(args.table, rule)
    if args.table and not store.has_table(args.table):
        raise PolicyError(f"{args.database} has no table {args.table!r}")
    tables = [ledger.budget_table(args.table)] if args.table else ledger.budgets()
    reports = {t: ledger.report(t) for t in tables}  # stored with the last charge: no composing
    statuses = [reports[t][0].as_dict() for t in tables]
    windows = {t: [w.as_dict() for w in ledger.windows(t)] for t in tables}
    spends = {t: [_with_event(s) for s in ledger.spends(t)] for t in tables}
    plans = {t: reports[t][1] for t in tables}
    if args.json:
        print(json.dumps([{**s, "windows": windows[s["protected_table"]],
                           "spends": spends[s["protected_table"]],
                           "jobs": plans[s["protected_table"]]} for s in statuses],
                         default=str, indent=2))  # fmt: skip
        return
    print(_text_table(statuses))
    for status in statuses:
        table = str(status["protected_table"])
        _print_windows(table, windows[table])
        _print_events(table, status["delta_total"], spends[table])
        _print_plan(table, plans[table])


def _with_event(spend: dict[str, Any]) -> dict[str, Any]:
    """A spend row with its event as a dict (the ledger stores it as JSON text)."""
    event = spend.get("event")
    return {**spend, "event": json.loads(event) if isinstance(event, str) else event}


def _print_events(table: str, delta: float, spends: list[dict[str, Any]]) -> None:
    """Each release charged to ``table``: its event, job and time."""
    from core.dp.accounting import event_from_dict

    if not spends:
        return
    print(f"\nevents of {table} (composed into epsilon_spent at the owner's delta {delta:g}):")
    keys = ("created_at", "job_id", "mechanism", "epsilon", "delta", "consumer")
    rows = [
        {**{k: s.get(k) for k in keys}, "event": event_from_dict(s["event"]).describe()}
        for s in spends
    ]
    print(_text_table(rows))


def _print_plan(table: str, plans: list[dict[str, Any]]) -> None:
    """Per job that spent from ``table``: how many more runs of its latest event fit."""
    from core.dp.accounting import MAX_RUNS

    if not plans:
        return
    print(f"\nruns left on {table}:")
    for plan in plans:
        runs, count = plan["runs_left"], "run" if plan["runs_left"] == 1 else "runs"
        more = f"{runs}+" if runs >= MAX_RUNS else str(runs)
        print(f"  {plan['job_id']}: {more} more {count} of {plan['mechanism']}")


def _print_windows(table: str, windows: list[dict[str, Any]]) -> None:
    """Each window rule of ``table``: its caps, the window's spend (per consumer) and when the
    window refreshes."""
    if not windows:
        return
    print(f"\nwindows of {table}:")
    rows = [{k: v for k, v in w.items() if k != "by_consumer"} for w in windows]
    print(_text_table([{k: "-" if v is None else v for k, v in r.items()} for r in rows]))
    for window in windows:
        for consumer, spent in window["by_consumer"].items():
            print(f"  {window['set_by']} window: {consumer} spent {spent:g}")


def _policy(args: argparse.Namespace) -> None:
    """The owner's permissions: everything that gives up privacy is off until set here."""
    from storage.ledger import PrivacyLedger
    from storage.policy import OwnerPolicy, PolicyError

    store = _existing_store(args.database)
    policy = OwnerPolicy(store)
    if args.action == "set":
        chosen = {k: getattr(args, k) for k in ("allow_noiseless_release", "allow_raw_export")}
        policy.set(args.table, **{k: v for k, v in chosen.items() if v is not None})
    if args.table and not store.has_table(args.table):
        raise PolicyError(f"{args.database} has no table {args.table!r}")
    tables = [args.table] if args.table else PrivacyLedger(store).budgets()
    rows = [policy.get(table).as_dict() for table in tables]
    print(json.dumps(rows, indent=2) if args.json else _text_table(rows))


def _models(args: argparse.Namespace) -> None:
    from storage.models import ModelStore

    models = ModelStore(_existing_store(args.database))
    if args.action == "list":
        listed = models.list()
        if not listed:
            print(f"no models in {args.database}")
        for m in listed:
            promoted = f"  promoted for {', '.join(m.promoted_for)}" if m.promoted_for else ""
            job = f"job {m.job or '-'}"
            print(f"{m.created or m.saved_at:<25}  {m.flow:<10}  {job}  {m.key}{promoted}")
        return
    if args.action == "promote":
        job = models.promote(args.key, args.job)
        print(f"{args.key} now scores job {job} (its {models.load(args.key).flow} model)")
        return
    model = models.load(args.key)
    if args.action == "show":
        _show_model(args.key, model)
        return
    Path(args.out).write_text(model.to_json())
    print(f"wrote {args.out}")


def _show_model(key: str, model: ModelRecord) -> None:
    print(f"model {key}")
    items = {
        "flow": model.flow,
        "job": model.job or "-",
        "job id": model.job_id,
        "held by": model.party or "-",
        "share": "yes: this party's features only" if model.share else "no: the whole model",
        "link": model.link,
        "created": model.created,
        "rows": ", ".join(f"{n:,} {what}" for what, n in model.rows.items()) or "-",
        "trained on": ", ".join(model.fingerprints) or "-",
        "preprocessing": "stored" if model.preprocessing else "none",
    }
    for name, value in items.items():
        print(f"  {name}: {value}")
    if model.intercept is not None:
        print(f"  intercept: {model.intercept:.6g}")
    width = max((len(f) for f in model.features), default=7)
    print(f"  {'feature':<{width}}  coefficient")
    for feature, coefficient in zip(model.features, model.coefficients, strict=True):
        print(f"  {feature:<{width}}  {coefficient:.6g}")


def _paillier(args: argparse.Namespace) -> None:
    """Work done ahead of a vertical LR run (see tasks/vertical_lr.py for why it is sound)."""
    from federation.workspace import channel_for
    from tasks import vertical_lr as steps

    job = steps.keys_job(
        args.job_id,
        args.guest,
        tuple(h for h in args.hosts.split(",") if h),
        args.key_holder,
        args.database if args.action == "prepare-key" else "",
        channel=channel_for(args.job_id, args.workspace),
        randomizer=args.randomizer,
        key_size=args.key_size,  # fill-pool checks the key holder's n against it
    )
    if args.action == "prepare-key":
        bits = steps.prepare_key(job, args.key_size)
        print(f"job {args.job_id}: {bits}-bit key pair ready; n sent to the other parties")
        return
    from storage.descriptor import TableRef

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

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A mistyped choice (a subcommand, an action) is refused with the closest one."""
        try:
            super()._check_value(action, value)  # type: ignore[misc]
        except argparse.ArgumentError as error:
            choices = [str(choice) for choice in action.choices or ()]
            close = difflib.get_close_matches(str(value), choices, n=1)
            if not close:
                raise
            raise argparse.ArgumentError(
                action, f"{error.message}; did you mean {close[0]!r}?"
            ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="privreg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=f"%(prog)s {bundled.version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    formatter = argparse.ArgumentDefaultsHelpFormatter  # every option's help shows its default
    load = commands.add_parser(
        "load", help="validate and import a CSV or Parquet file", formatter_class=formatter
    )
    load.add_argument("source", help="CSV, CSV.gz or Parquet file")
    load.add_argument("--database", required=True, help="the party's DuckDB file")
    load.add_argument(
        "--table", required=True, help="table to create (an existing one: --replace or --append)"
    )
    load.add_argument("--party", help="the owner's name (default: the database file's name)")
    load.add_argument("--id-column", default="id", help="column PSI matches on")
    load.add_argument("--label-column", help="the label column, if this party holds it")
    load.add_argument("--label-domain", help="comma-separated allowed label values, e.g. 0,1")
    existing = load.add_mutually_exclusive_group()
    existing.add_argument(
        "--replace", action="store_true", help="replace the table if it exists (prints both counts)"
    )
    existing.add_argument(
        "--append",
        action="store_true",
        help="add the file's rows to the existing table (ids must be new; the whole is validated)",
    )
    load.set_defaults(handler=_load)
    run = commands.add_parser(
        "run",
        help="run a job file here (a main job, or a sub-job file on its own)",
        formatter_class=formatter,
    )
    run.add_argument("job_file", help="the job file (JSON), validated in full before it runs")
    run.add_argument("--workspace", help="folder for the run's messages (default: var)")
    run.add_argument(
        "--run", default="", help="a new run: appended to every job id (<job>-<stage>-RUN)"
    )
    run.add_argument(
        "--log-dir", default="var/logs", help="folder of the run's full log (Prefect's lines)"
    )
    run.set_defaults(handler=_run)
    budget = commands.add_parser(
        "budget", help="show or set a table's privacy budget", formatter_class=formatter
    )
    budget.add_argument(
        "action", choices=["show", "set", "window"],
        help="show, set a total, or set the owner's window rule (what may be spent per window)",
    )  # fmt: skip
    budget.add_argument("--database", required=True, help="the owner's DuckDB file")
    budget.add_argument("--table", help="the protected table (show: default every table)")
    budget.add_argument(
        "--epsilon", type=float, help="set: the total epsilon, > 0; window: per window"
    )
    budget.add_argument("--delta", type=float, default=0.0, help="set: the total delta, [0, 1)")
    budget.add_argument(
        "--per-consumer", type=float, help="window: the most one consumer gets per window"
    )
    budget.add_argument("--hours", type=float, default=24.0, help="window: its length (24)")
    budget.add_argument("--off", action="store_true", help="window: remove the owner's rule")
    budget.add_argument("--json", action="store_true", help="print JSON instead of a table")
    budget.set_defaults(handler=_budget)
    policy = commands.add_parser(
        "policy",
        help="show or set what a table's owner allows (no-noise releases, raw rows)",
        formatter_class=formatter,
    )
    policy.add_argument("action", choices=["show", "set"], help="show, or set permissions")
    policy.add_argument("--database", required=True, help="the owner's DuckDB file")
    policy.add_argument("--table", help="the protected table (show: default every table)")
    for name, what in (
        ("allow-noiseless-release", "a release without noise (tests)"),
        ("allow-raw-export", "exporting raw rows"),
    ):
        policy.add_argument(
            f"--{name}", action=argparse.BooleanOptionalAction, default=None,
            help=f"set: allow or refuse {what} (unset: unchanged)",
        )  # fmt: skip
    policy.add_argument("--json", action="store_true", help="print JSON instead of a table")
    policy.set_defaults(handler=_policy)
    models = commands.add_parser(
        "models",
        help="list, show, export saved models; promote the one scoring uses",
        formatter_class=formatter,
    )
    models.add_argument("action", choices=["list", "show", "export", "promote"], help="what to do")
    models.add_argument("--database", required=True, help="the party's DuckDB file")
    models.add_argument("--key", help="show, export, promote: the model's key (see list)")
    models.add_argument("--out", help="export: the JSON file to write")
    models.add_argument(
        "--job", help="promote: the job whose scoring uses it (default: the model's own job)"
    )
    models.set_defaults(handler=_models)
    paillier = commands.add_parser(
        "paillier",
        help="prepare a vertical job's key and a party's obfuscators ahead of its run",
        formatter_class=formatter,
    )
    paillier.add_argument("action", choices=["prepare-key", "fill-pool"], help="what to prepare")
    paillier.add_argument("--job-id", required=True, help="the job id every party agreed on")
    paillier.add_argument("--guest", required=True, help="the guest party's name")
    paillier.add_argument("--hosts", required=True, help="comma-separated, in the job's order")
    paillier.add_argument("--key-holder", default="arbiter", help="the party holding the key")
    paillier.add_argument("--database", required=True, help="this party's own database")
    paillier.add_argument("--party", help="this party's name (default: the database's name)")
    paillier.add_argument("--workspace", help="the shared message folder (embedded runs)")
    paillier.add_argument("--key-size", type=int, default=2048, help="Paillier modulus bits")
    paillier.add_argument(
        "--randomizer", default="full", choices=["full", "short", "standard"],
        help="how obfuscators are drawn",
    )  # fmt: skip
    paillier.add_argument("--count", type=int, help="obfuscators to add to the pool")
    paillier.add_argument("--rows", type=int, help="or: the job's rows, to compute the count")
    paillier.add_argument("--batch-size", type=int, default=1024, help="with --rows")
    paillier.add_argument("--holdout-fraction", type=float, default=0.1, help="with --rows")
    paillier.add_argument("--epochs", type=int, default=1, help="with --rows")
    paillier.set_defaults(handler=_paillier)
    score_cli.register(commands)
    party_cli.register(commands)
    demo_cli.register(commands)
    job_check.register_check(job_cli.register(commands))
    for _, sub in _subcommands(parser):  # every option's help shows its default
        sub.formatter_class = formatter
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand's parser, nested ones included, with its name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from _subcommands(sub)


def _usage_error(args: argparse.Namespace) -> str | None:
    """What a subcommand's options lack or get wrong, checked before anything is opened."""
    if args.command == "budget" and args.action == "set":
        if not args.table or args.epsilon is None:
            return "budget set needs --table and --epsilon"
        if not args.epsilon > 0:
            return f"--epsilon must be > 0 (got {args.epsilon:g})"
        if not 0 <= args.delta < 1:
            return f"--delta must be in [0, 1) (got {args.delta:g})"
    if args.command == "job" and args.job_command == "status" and not args.every > 0:
        return f"--every must be > 0 seconds (got {args.every:g})"
    if args.command == "policy" and args.action == "set" and not args.table:
        return "policy set needs --table"
    if args.command == "models" and args.action == "export" and not (args.key and args.out):
        return "models export needs --key and --out"
    if args.command == "models" and args.action in ("show", "promote") and not args.key:
        return f"models {args.action} needs --key"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _usage_error(args)
    if problem is not None:
        print(f"privreg: error: {problem}", file=sys.stderr)
        return 1
    try:
        args.handler(args)
    except Exception as error:
        if args.debug:
            traceback.print_exc()
        # a short block (the file, each key, a suggestion); the schema's module is loaded only
        # by commands that read a job file (its import costs half a second)
        schema = sys.modules.get("core.job_schema")
        if schema is not None and isinstance(error, schema.JobFileError):
            print(f"privreg: error: {error}", file=sys.stderr)
        else:
            print(f"privreg: error: {one_line(error)}", file=sys.stderr)
        if isinstance(error, RunFailedError):
            print(f"privreg: full log: {error.log}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
