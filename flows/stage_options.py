"""A local runner's keyword options, generated from its stage's model in ``core/job_schema.py``.

The model is the one declaration of an option (name, type, default, bounds, description). Party
flows take it whole (``options``); public local runners (``walr(features, labels, epsilon=1.0,
...)``) keep keywords built from it, so Prefect's form, ``help()`` and the call agree.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])


def keyword_options(model: type[BaseModel]) -> Callable[[F], F]:
    """Give ``fn(..., *, options: model)`` one keyword parameter per field of ``model`` in
    place of ``options``; the call validates them into the model (its defaults fill the rest)."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)
        fixed = [p for name, p in signature.parameters.items() if name != "options"]
        keywords = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=inspect.Parameter.empty if field.is_required() else field.default,
                annotation=Annotated[(field.annotation, *field.metadata)]
                if field.metadata
                else field.annotation,  # Prefect checks the bounds too, naming the option
            )
            for name, field in model.model_fields.items()
        ]

        @functools.wraps(fn)
        def runner(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in list(kwargs) if name in model.model_fields}
            return fn(*args, options=model.model_validate(values), **kwargs)

        runner.__signature__ = signature.replace(parameters=[*fixed, *keywords])  # type: ignore[attr-defined]
        runner.__doc__ = _with_option_docs(fn.__doc__ or "", model)
        return runner  # type: ignore[return-value]

    return wrap


def _with_option_docs(doc: str, model: type[BaseModel]) -> str:
    """The docstring's ``Args:`` section, followed by one line per option (its description),
    so Prefect's form describes every field."""
    lines = [f"        {name}: {field.description}" for name, field in model.model_fields.items()]
    return doc.rstrip() + "\n" + "\n".join(lines) + "\n"
