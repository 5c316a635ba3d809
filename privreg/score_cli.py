"""``privreg score``: a table's new rows scored with a saved model, without a deployment.

A model one party holds whole (horizontal, WALR, label DP, sparse LDA) is applied here by the
``score_local`` flow, the code a deployment runs, so the scores in ``<table>_scored`` are the
flow's own. A vertical model is split across organisations and no share scores alone: for one,
the command names the job-file command that scores it by each party's share
(``score_vertical``). The model and the table's columns are checked before Prefect starts, so
a wrong key or a missing column costs one line, not a server's start-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from privreg.run_log import flow_command, log_path

if TYPE_CHECKING:
    from storage.descriptor import TableRef
    from storage.models import ModelStore

#: The flows whose models one party holds whole; ``vertical`` names the split one.
LOCAL_FLOWS = ("horizontal", "walr", "label_dp", "sparse_lda")


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``score`` to the ``privreg`` command."""
    score = commands.add_parser(
        "score", help="score a table's new rows with a saved model, into <table>_scored"
    )
    score.add_argument("--database", required=True, help="the party's DuckDB file")
    score.add_argument(
        "--table", required=True, help="the table of new rows (with --source: loaded into it)"
    )
    score.add_argument(
        "--source", help="a CSV, CSV.gz or Parquet file of new rows, loaded first as privreg load"
    )
    existing = score.add_mutually_exclusive_group()
    existing.add_argument(
        "--replace", action="store_true", help="--source: replace the table if it exists"
    )
    existing.add_argument(
        "--append", action="store_true", help="--source: add the file's rows to the table"
    )
    score.add_argument("--id-column", default="id", help="the table's id column")
    score.add_argument("--label-column", help="the label column, if the rows have one (an AUC)")
    chosen = score.add_mutually_exclusive_group()
    chosen.add_argument("--model", help="the model's key (privreg models list shows them)")
    chosen.add_argument("--job", help="or: the job whose promoted model scores")
    score.add_argument(
        "--flow",
        choices=[*LOCAL_FLOWS, "vertical"],
        help="with --job: which flow's promoted model, if the job promoted several",
    )
    score.add_argument(
        "--log-dir", default="var/logs", help="folder of the run's full log (Prefect's lines)"
    )
    score.set_defaults(handler=_score)


def _score(args: argparse.Namespace) -> None:
    """Load the new rows (``--source``), check the model and the table, then run
    ``score_local`` with Prefect's lines in a log file; print where the scores are."""
    from storage.descriptor import TableRef
    from storage.models import ModelStore
    from storage.party_store import PartyStore

    if not (args.model or args.job):
        raise ValueError("score needs --model KEY or --job JOB (privreg models list shows them)")
    if args.source:
        _load_source(args)
    ref = TableRef(args.database, args.table, args.id_column, args.label_column)
    if not Path(args.database).is_file():
        raise FileNotFoundError(f"database {args.database} does not exist")
    models = ModelStore(PartyStore.of(ref))
    key = args.model or _promoted_key(models, args.job, args.flow)
    _check_columns(ref, models, key)
    log = log_path(args.log_dir, f"score-{args.table}")
    with flow_command(log, f"privreg score --table {args.table} ({key})") as printer:
        from flows.scoring import score_local  # Prefect only for a command that runs a flow

        result = score_local(ref.to_dict(), model_key=key)
    _print_result(ref, result)
    print(f"finished in {time.monotonic() - printer.started:.1f} s (log: {log})", file=sys.stderr)


def _load_source(args: argparse.Namespace) -> None:
    """``--source`` into ``--table`` by ``privreg load``'s own code (and its rules)."""
    from privreg import cli  # imported here: cli registers this command

    load = argparse.Namespace(
        source=args.source, database=args.database, table=args.table, party=None,
        id_column=args.id_column, label_column=args.label_column, label_domain=None,
        replace=args.replace, append=args.append,
    )  # fmt: skip
    cli._load(load)


def _promoted_key(models: ModelStore, job: str, flow: str | None) -> str:
    """The model promoted for ``job`` (and ``flow``, needed when the job promoted several)."""
    if flow is None:
        flows = sorted({m.flow for m in models.list() if job in m.promoted_for})
        if len(flows) > 1:
            raise ValueError(
                f"job {job!r} has promoted models of {len(flows)} flows ({', '.join(flows)}): "
                "choose one with --flow"
            )
        flow = flows[0] if flows else LOCAL_FLOWS[0]  # none: the refusal names the command
    key, _ = models.promoted(job, flow)
    return key


def _check_columns(ref: TableRef, models: ModelStore, key: str) -> None:
    """Refuse a vertical share (naming the command that scores it), a table that is not there
    and one lacking a column the model reads."""
    model = models.load(key)
    if model.share:
        raise ValueError(_vertical_command(models, key, ref))
    store = models.store
    if not store.has_table(ref.table):
        raise ValueError(f"{store.path.name} has no table {ref.table!r} (--source loads one)")
    with store.connect() as con:
        found = [d[0] for d in con.execute(f'SELECT * FROM "{ref.table}" LIMIT 0').description]
    named = {ref.id_column: "--id-column", ref.label_column: "--label-column"}
    for column, option in named.items():
        if column and column not in found:
            raise ValueError(f"table {ref.table!r} has no column {column!r} ({option})")
    inputs = model.input_columns()
    missing = [c for c in inputs if c not in found]
    if missing:
        raise ValueError(
            f"table {ref.table!r} lacks the model's column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)} (model {key} reads {len(inputs)} columns)"
        )


def _vertical_command(models: ModelStore, key: str, ref: TableRef) -> str:
    """What scores a vertical model: a ``score_vertical`` job file run by every party."""
    promoted = [job for m in models.list() if m.key == key for job in m.promoted_for]
    job = promoted[0] if promoted else "JOB"
    first = (
        ""
        if promoted
        else f"promote it (privreg models promote --database {ref.database} --key {key} "
        "--job JOB), then "
    )
    return (
        f"{key} is one party's share of a vertical model, which scores only with every "
        "party's share, across organisations: write a score_vertical job file as "
        f'jobs/score_demo.json (the guest\'s table {ref.table}, "score_vertical": {{"model_job": '
        f'"{job}"}}), then {first}privreg job start JOB_FILE --config party.toml (every party '
        "runs its side; privreg run JOB_FILE runs them all here)"
    )


def _print_result(ref: TableRef, result: dict) -> None:
    """Where the scores are and what they are: rows, model, AUC when the rows have labels."""
    seen = result["in_training"]
    print(
        f"{result['rows']} rows of {ref.table} scored with {result['model_key']} into "
        f"{result['scores_table']} of {ref.database}"
    )
    print(
        f"  {seen['train']} the model trained on, {seen['held out']} it held out, "
        f"{seen['unseen']} new to it"
    )
    if result["auc"] is not None:
        print(f"  AUC {result['auc']:.4f} against {ref.label_column}")
