"""Table descriptors: the small JSON that names one party's table.

Flows take descriptors as parameters (never data), so a deployment can pass them from a job
file and the Prefect server stores only paths and names.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class DescriptorError(ValueError):
    """A table descriptor is malformed."""


def check_identifier(name: str, what: str) -> str:
    """Table and column names go into SQL, so they must be plain identifiers."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise DescriptorError(f"{what} {name!r} is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return name


@dataclass(frozen=True)
class TableRef:
    """Where one party's table lives and how to read it.

    ``feature_columns`` of ``None`` means every column except the id and the label.
    ``label_domain`` lists the allowed label values (e.g. ``[0, 1]``); ``None`` allows any
    finite number.
    """

    database: str
    table: str
    id_column: str = "id"
    label_column: str | None = None
    feature_columns: tuple[str, ...] | None = None
    label_domain: tuple[float, ...] | None = None
    party: str = field(default="")

    def __post_init__(self) -> None:
        check_identifier(self.table, "table")
        check_identifier(self.id_column, "id column")
        if self.label_column is not None:
            check_identifier(self.label_column, "label column")
        if self.feature_columns is not None:
            object.__setattr__(self, "feature_columns", tuple(self.feature_columns))
            for column in self.feature_columns:
                check_identifier(column, "feature column")
        if self.label_domain is not None:
            object.__setattr__(self, "label_domain", tuple(self.label_domain))
        if not self.party:
            object.__setattr__(self, "party", Path(self.database).stem)
        check_identifier(self.party, "party")

    @property
    def path(self) -> Path:
        return Path(self.database)

    def with_table(self, table: str) -> TableRef:
        return replace(self, table=table)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("feature_columns", "label_domain"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | TableRef) -> TableRef:
        if isinstance(data, TableRef):
            return data
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise DescriptorError(f"unknown descriptor keys: {sorted(unknown)}")
        if "database" not in data or "table" not in data:
            raise DescriptorError("a descriptor needs at least 'database' and 'table'")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> TableRef:
        return cls.from_dict(json.loads(text))
