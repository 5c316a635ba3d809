"""A party's own budgets file: the ``[budgets]`` tables of the party.toml its process runs with.

```toml
[budgets.patients]        # one of this organisation's tables, by name
epsilon = 4.0
delta = 1e-5              # optional, 0 by default
```

Why it exists: in party mode every organisation reads the same job file, whose author may be
a partner, so a ``privacy_budget`` written there is not the table owner's decision and is never
applied (see ``tasks.loading``). The owner grants a budget in its own file, or with
``privreg budget set``. The file only fills in a budget the owner's store does not have yet:
``privreg budget set`` changes it afterwards, and no load raises, resets or tops one up.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from federation.party_config import ENV_VAR


class OwnerBudgetError(ValueError):
    """The owner's budgets file names a budget that cannot be used (file and table named)."""


@dataclass(frozen=True)
class OwnerBudget:
    """The total budget an owner grants one of its tables."""

    epsilon: float
    delta: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"epsilon": self.epsilon, "delta": self.delta}


def owner_budgets(path: str | Path | None = None) -> dict[str, OwnerBudget]:
    """The budgets in ``path`` (default: the party.toml this process runs as; none when the
    process runs embedded), by table name."""
    where = path if path is not None else os.environ.get(ENV_VAR)
    if not where:
        return {}
    try:
        raw = tomllib.loads(Path(where).read_text()).get("budgets", {})
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise OwnerBudgetError(f"{where}: {error}") from error
    if not isinstance(raw, dict):
        raise OwnerBudgetError(f"{where}: [budgets] must hold one table per protected table")
    return {table: _budget(where, table, entry) for table, entry in raw.items()}


def _budget(where: str | Path, table: str, entry: object) -> OwnerBudget:
    what = f"{where}: [budgets.{table}]"
    if not isinstance(entry, dict) or set(entry) - {"epsilon", "delta"}:
        raise OwnerBudgetError(f"{what} takes epsilon and an optional delta, got {entry!r}")
    epsilon, delta = entry.get("epsilon"), entry.get("delta", 0.0)
    for name, value in (("epsilon", epsilon), ("delta", delta)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise OwnerBudgetError(f"{what}: {name} must be a number, got {value!r}")
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0 <= delta < 1:
        raise OwnerBudgetError(f"{what}: needs epsilon > 0 and 0 <= delta < 1")
    return OwnerBudget(float(epsilon), float(delta))
