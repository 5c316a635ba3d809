"""``privreg`` speaks plainly: every option says what it does and its default, and a wrong path
or value is an error naming it, not an empty result."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import pytest
from test_cli import _error_line

from privreg.cli import build_parser, main
from storage.descriptor import TableRef
from storage.party_store import PartyStore


def _subparsers(parser: argparse.ArgumentParser, prog: str = "privreg"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}", sub
                yield from _subparsers(sub, f"{prog} {name}")


def test_every_option_has_help_with_its_default() -> None:
    missing = []
    for prog, parser in _subparsers(build_parser()):
        helped = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help:
                missing.append(f"{prog} {name}: no help")
            elif (
                action.option_strings
                and action.default not in (None, False, argparse.SUPPRESS)
                and f"(default: {action.default})" not in " ".join(helped.split())
            ):
                missing.append(f"{prog} {name}: default {action.default!r} not shown")
    assert not missing, "\n".join(missing)


def test_wrong_paths_and_values_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = tmp_path / "misspelt.duckdb"
    for command in ("budget", "policy", "models"):
        line = _error_line(capsys, [command, "show" if command != "models" else "list",
                                    "--database", str(absent)])  # fmt: skip
        assert line == f"privreg: error: database {absent} does not exist"
    assert not absent.exists()  # nothing created by looking

    ref = TableRef(str(tmp_path / "bank.duckdb"), "customers")
    PartyStore.of(ref).import_frame(pd.DataFrame({"id": [1, 2], "x": [0.5, 1.5]}), ref)
    setting = ["budget", "set", "--database", ref.database, "--table", "customers"]
    assert _error_line(capsys, [*setting, "--epsilon", "0"]) == (
        "privreg: error: --epsilon must be > 0 (got 0)"
    )
    assert "--delta must be in [0, 1)" in _error_line(
        capsys, [*setting, "--epsilon", "1", "--delta", "1"]
    )
    assert _error_line(capsys, setting) == "privreg: error: budget set needs --table and --epsilon"
    assert main([*setting, "--epsilon", "2"]) == 0
    assert "customers" in capsys.readouterr().out
