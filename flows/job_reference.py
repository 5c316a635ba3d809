"""The docs' job-file reference, generated from ``core.job_schema`` so it cannot drift.

``privreg job schema --markdown`` prints it; ``python -m flows.job_reference`` writes it into
``docs/reference/job-file.md`` between the markers (the page's opening above them is written
by hand); ``tests/test_job_schema.py`` checks that the page's section equals this text.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types as at
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from core import job_schema as schema

BEGIN = "<!-- job-file-reference:begin (generated: privreg job schema --markdown) -->"
END = "<!-- job-file-reference:end -->"
PAGE = "docs/reference/job-file.md"
"""The docs page that holds the reference, relative to the repository."""

SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("Main job (`privreg run jobs/demo.json`)", schema.MainJob),
    ("Sub-job `label_dp`", schema.LabelDPJob),
    ("Sub-job `horizontal_lr`", schema.HorizontalJob),
    ("Sub-job `sparse_lda`", schema.SparseLDAJob),
    ("Sub-job `score_vertical`", schema.ScoreVerticalJob),
    ("Roles of a main or label-DP job (`parties`)", schema.GuestHost),
    ("A party's entry (`parties.<role>`)", schema.PartyEntry),
    ("Table descriptor (`parties.<role>.table`)", schema.TableDescriptor),
    ("Initial privacy budget (`parties.<role>.privacy_budget`)", schema.PrivacyBudget),
    ("Preprocessing (job level)", schema.Preprocessing),
    ("Preprocessing (a party's own, `parties.<role>.preprocessing`)", schema.PartyPreprocessing),
    ("`subjobs`", schema.SubJobs),
    ("`psi`", schema.PsiOptions),
    ("`vertical`", schema.VerticalOptions),
    ("`walr`", schema.WalrOptions),
    ("`label_dp`", schema.LabelDPOptions),
    ("`horizontal_lr`", schema.HorizontalOptions),
    ("`sparse_lda`", schema.SparseLDAOptions),
    ("`score_vertical`", schema.ScoreOptions),
)
_NAMES = {model: title for title, model in SECTIONS}


def markdown() -> str:
    """Every kind of job file, object and option: key, type and range, default, meaning."""
    lines = [
        "Every key below is checked before anything is loaded: an unknown key is refused with the "
        "closest valid one, a wrong type or a value out of range with its path "
        "(`privreg job check FILE` prints a job with every default filled in). A sub-job file "
        "is recognised by its stage key.",
    ]
    for title, model in SECTIONS:
        summary = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
        lines += ["", f"## {title}", "", summary.replace("``", "`"), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            kind = _type_text(field.annotation, field.metadata)
            lines.append(f"| `{name}` | {kind} | {_default(field)} | {field.description or ''} |")
    return "\n".join(lines) + "\n"


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(its defaults)" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{json.dumps(field.default)}`"


def _type_text(annotation: Any, metadata: list[Any]) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0], [*metadata, *args[1:]])
    if origin in (Union, types.UnionType):
        parts = [_type_text(a, metadata) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or `null`" if type(None) in args else "")
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is list:
        return f"list of {_type_text(args[0], [])}{_range(metadata)}"
    if origin is dict:
        return f"object of {_type_text(args[1], [])}{_range(metadata)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"object ({_NAMES[annotation].split(' (')[0]})"
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    return names.get(annotation, str(annotation)) + _range(metadata)


def _range(metadata: list[Any]) -> str:
    bounds: dict[str, Any] = {}
    for item in [m for entry in metadata for m in [entry, *getattr(entry, "metadata", [])]]:
        for attr in ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern"):
            value = getattr(item, attr, None)
            if value is not None:
                bounds[attr] = value
        if isinstance(item, at.Interval):
            bounds.update({k: v for k, v in vars(item).items() if v is not None})
    if "pattern" in bounds:
        return " (a plain name)"
    low = next(
        (f"{sign} {bounds[k]:g}" for k, sign in (("gt", ">"), ("ge", ">=")) if k in bounds), ""
    )
    high = next(
        (f"{sign} {bounds[k]:g}" for k, sign in (("lt", "<"), ("le", "<=")) if k in bounds), ""
    )
    if "min_length" in bounds and bounds.get("min_length") == bounds.get("max_length"):
        return f" (exactly {bounds['min_length']})"
    if "min_length" in bounds:
        return f" (at least {bounds['min_length']})"
    return f" ({', '.join(b for b in (low, high) if b)})" if low or high else ""


def section(page: str) -> str:
    """The text between the page's markers (what ``markdown()`` must equal)."""
    return page.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_section(page: str) -> str:
    """``page`` with the text between its markers replaced by ``markdown()``."""
    head, rest = page.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{markdown()}{END}{rest.split(END, 1)[1]}"


if __name__ == "__main__":  # python -m flows.job_reference: rewrite the page's section
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / PAGE
    page.write_text(with_section(page.read_text()))
