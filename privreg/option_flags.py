"""A stage's command-line options, generated from its model in ``core/job_schema.py``.

``privreg party walr --clip-norm 2`` and ``--options '{"clip_norm": 2}'`` are the same model's
fields: one flag per field (type, choices and help from the model), the JSON for a whole set,
flags overriding it, and the model validating the result as it validates a job file.
"""

from __future__ import annotations

import argparse
import functools
import json
import typing
from pathlib import Path
from typing import Any, Literal

if typing.TYPE_CHECKING:
    from pydantic import BaseModel


def defer_option_flags(
    parser: argparse.ArgumentParser, model: str, skip: tuple[str, ...] = ()
) -> None:
    """:func:`add_option_flags` of ``core.job_schema``'s ``model``, added only when this
    command is the one parsed: importing the models costs half a second that ``privreg
    --help`` and every other command need not pay. The parser keeps its own class's ways
    (``privreg``'s one-line usage errors)."""
    parser.__class__ = _deferring(type(parser))
    parser._deferred = (model, skip)  # type: ignore[attr-defined]


@functools.cache
def _deferring(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """``base`` with :class:`_WithDeferredFlags`' parsing (one class per base)."""
    if issubclass(base, _WithDeferredFlags):
        return base
    return type(f"Deferring{base.__name__}", (_WithDeferredFlags, base), {})


class _WithDeferredFlags(argparse.ArgumentParser):
    _deferred: tuple[str, tuple[str, ...]] | None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._deferred is not None:
            from core import job_schema

            model, skip = self._deferred
            self._deferred = None
            add_option_flags(self, getattr(job_schema, model), skip)
        return super().parse_known_args(args, namespace)


def add_option_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()
) -> None:
    """``--options JSON`` and one flag per field of ``model`` (``skip``: fields the command
    sets another way); a flag left out takes the model's default."""
    from core import job_schema

    parser.add_argument(
        "--options", help=f"{model.__name__} as JSON or a JSON file; the flags below override it"
    )
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        required = " (required)" if field.is_required() else ""
        shown = "" if field.is_required() else f" [{field.default}]"
        extra = {"help": f"{field.description}{shown}{required}", "default": argparse.SUPPRESS}
        kind = job_schema.bare_type(field.annotation)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **extra)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, type=float, nargs="+", **extra)
        elif typing.get_origin(kind) is Literal:
            parser.add_argument(flag, choices=typing.get_args(kind), **extra)
        else:
            parser.add_argument(flag, type=kind if kind in (int, float) else str, **extra)


def options_from(
    args: argparse.Namespace, model: type[BaseModel], skip: tuple[str, ...] = ()
) -> BaseModel:
    """The command's ``--options`` overridden by its flags (``skip``: arguments of the same
    name that are not the field), validated by ``model``; a refusal names each field (a
    ``SystemExit``, as argparse's own)."""
    values = json_value(args.options) if getattr(args, "options", None) else {}
    flags = {k: v for k, v in vars(args).items() if k in model.model_fields and k not in skip}
    values.update(flags)
    return validated(model, values, model.__name__)


def validated(model: type[BaseModel], values: Any, what: str) -> Any:
    """``values`` as ``model``, or a ``SystemExit`` naming ``what`` and each refused field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or what}: {e['msg']}" for e in error.errors()
        )
        raise SystemExit(f"{what} refused: {problems}") from None


def json_value(text: str) -> Any:
    """Inline JSON, or the path of a file holding it. An object is never looked up as a path:
    one longer than a file name may be (255 bytes) made the lookup fail."""
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if path.exists():
            return json.loads(path.read_text())
    return json.loads(text)
