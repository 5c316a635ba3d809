"""The command-line reference page, generated from ``privreg.cli.build_parser()``.

``python docs/cli_reference.py`` rewrites ``docs/reference/cli.md``; ``tests/test_docs.py``
fails when the committed page differs from what the parser says now. The page is committed,
not made at build time, so it also reads as plain markdown in the repository.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"
WIDTH = "100"  # argparse wraps usage lines at the terminal's width: fixed, so the page is stable

# a stage's flags come from its options model: link each model to its job-file section
_SECTIONS = {
    "PsiOptions": "psi",
    "VerticalOptions": "vertical",
    "WalrOptions": "walr",
    "LabelDPOptions": "label_dp",
    "HorizontalOptions": "horizontal_lr",
    "SparseLDAOptions": "sparse_lda",
}

HEAD = """# Command line

`privreg` is what a data owner runs outside Prefect: load a table, run a job file, look at
budgets and models, and run as one party of a job across organisations. Errors print one line
naming what was wrong and exit with status 1; `privreg --debug ...` adds the traceback.
`privreg run` keeps Prefect's log lines out of the terminal: they go to
`var/logs/<job>-<UTC time>.log` (`--log-dir`), and on an error the terminal shows one line and
`privreg: full log: <file>`, where the traceback is.

This page is generated from the parser (`python docs/cli_reference.py`); `privreg COMMAND
--help` prints the same, with every default.
"""


def markdown() -> str:
    """Every command of ``privreg``: its usage, what it does, and each argument."""
    os.environ["COLUMNS"] = WIDTH
    sys.path.insert(0, str(ROOT))
    from privreg.cli import build_parser

    parts = [HEAD]
    for path, parser, help_text in _commands(build_parser(), ["privreg"], ""):
        parts.append(_command(path, parser, help_text))
    return "\n".join(parts)


def _commands(parser: argparse.ArgumentParser, path: list[str], help_text: str):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    yield path, parser, help_text
    for action in subs:
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            yield from _commands(sub, [*path, name], helps.get(name, ""))


def _command(path: list[str], parser: argparse.ArgumentParser, help_text: str) -> str:
    deferred = getattr(parser, "_deferred", None)
    if deferred is not None:  # the stage's flags, added as they are when the command runs
        from core import job_schema
        from privreg.option_flags import add_option_flags

        model, skip = deferred
        parser._deferred = None
        add_option_flags(parser, getattr(job_schema, model), skip)
    name = " ".join(path)
    lines = [f"## `{name}`", ""]
    if help_text:
        lines += [help_text[0].upper() + help_text[1:] + ".", ""]
    usage = parser.format_usage().removeprefix("usage: ").rstrip()
    usage = "\n".join(line.removeprefix(" " * len("usage: ")) for line in usage.splitlines())
    lines += ["```text", usage, "```", ""]
    if deferred is not None:
        model = deferred[0]
        lines += [
            f"The stage's options are `{model}`: `--options` takes them as JSON (or a JSON "
            "file), one flag per field overrides it (`--clip-norm` for `clip_norm`); see "
            f"[`{_SECTIONS[model]}`](job-file.md#{_SECTIONS[model]}) in the job-file reference.",
            "",
        ]
    rows = [_row(a) for a in parser._actions if not _skipped(a)]
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


def _skipped(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction | argparse._SubParsersAction)


def _row(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            names += f" `{action.metavar or action.dest.upper()}`"
    else:
        names = f"`{action.metavar or action.dest}`"
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        names += " (" + " \\| ".join(f"`{c}`" for c in action.choices) + ")"
    default = action.default
    if action.required or not action.option_strings:
        shown = "required"
    elif default is None or default is False or default == argparse.SUPPRESS:
        shown = ""
    else:
        shown = f"`{default}`" if default != "" else '`""`'
    meaning = (action.help or "").replace("%(prog)s", "privreg")
    meaning = meaning.replace("|", "\\|").replace("<", "&lt;")
    return f"| {names} | {shown} | {meaning} |"


if __name__ == "__main__":
    PAGE.write_text(markdown())
