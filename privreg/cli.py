"""``privreg``: what a data owner does outside Prefect.

privreg load SOURCE --database D --table T [--id-column C] [--label-column L] [--label-domain 0,1]
privreg run JOB_FILE                      run the pipeline of a job file locally
privreg budget set --database D --table T --epsilon E [--delta X]
privreg budget show --database D [--table T] [--json]
privreg policy set --database D --table T [--allow-noiseless-release | --no-allow-noiseless-release]
                   [--allow-raw-export | --no-allow-raw-export]
privreg policy show --database D [--table T] [--json]
privreg models list --database D
privreg models export --database D --key K --out FILE.json
privreg certs ... / privreg party ...     a party at its own organisation (privreg/party_cli.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from privreg import party_cli
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import BudgetError, PrivacyLedger
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


def _run(args: argparse.Namespace) -> None:
    from flows.pipeline import pipeline

    pipeline(args.job_file, workspace=args.workspace)


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
    artifacts = ArtifactStore(PartyStore(args.database))
    if args.action == "list":
        for key, _, size, created in artifacts.list("models/"):
            print(f"{created:%Y-%m-%d %H:%M:%S}  {size:>8} B  {key}")
        return
    model = artifacts.get(args.key)
    if model is None:
        raise SystemExit(f"no model {args.key!r} in {args.database}")
    Path(args.out).write_text(json.dumps(_plain(model), indent=2))
    print(f"wrote {args.out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="privreg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
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
    models = commands.add_parser("models", help="list or export saved models")
    models.add_argument("action", choices=["list", "export"])
    models.add_argument("--database", required=True)
    models.add_argument("--key")
    models.add_argument("--out")
    models.set_defaults(handler=_models)
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
    try:
        args.handler(args)
    except (BudgetError, ValueError) as error:  # the owner's own mistake: one line, exit 1
        print(f"privreg: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
