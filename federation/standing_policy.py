"""A party's standing policy: which jobs it takes part in without anyone touching it.

``party.toml`` may hold, next to the party's own paths:

```toml
[policy]
accept_from = ["clinic"]          # peers whose proposals start this party's side here
flows = ["main", "label_dp"]      # job kinds it takes part in (default: every kind)
max_epsilon_per_release = 1.0     # the most one release of its tables may spend
max_epsilon_per_day = 4.0         # the most all releases of one of its tables spend per window
max_epsilon_per_consumer = 2.0    # the most one consumer (a receiving peer) gets per window
budget_window_hours = 24          # the window's length: a UTC day by default
min_rows = 100                    # the least a job may accept as PSI's intersection
min_key_bits = 2048               # the least Paillier key size a job may use
approval = "auto"                 # "manual": a person approves each job in the party's Prefect
```

Every rule is checked against the job's terms at the party's own side before anything is
loaded or sent, whoever started it (a proposal, a schedule, a person), so a job a party's
policy refuses ends at every party with the rule that refused it.

The window caps are also enforced where they cannot be raced: at the charge, in the ledger's
own transaction (:mod:`storage.ledger`: each check and charge made as this party writes
:meth:`StandingPolicy.window_rule` into the owner's ledger before reading it), so two runs
that overlap cannot each pass the early check and each spend the cap.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.ledger import WindowRule

KINDS = ("main", "label_dp", "horizontal_lr", "sparse_lda", "score_vertical")
_RELEASES = {  # job kind -> the option groups whose epsilon a release of this party spends
    "main": ("walr",),
    "label_dp": ("label_dp",),
    "horizontal_lr": (),
    "sparse_lda": ("sparse_lda",),
}
_KEYS = {"main": ("vertical", "walr")}  # option groups with a Paillier key_size


class PolicyError(ValueError):
    """The ``[policy]`` table of a party.toml is malformed."""


@dataclass(frozen=True)
class StandingPolicy:
    accept_from: tuple[str, ...] = ()
    flows: tuple[str, ...] = KINDS
    max_epsilon_per_release: float | None = None
    max_epsilon_per_day: float | None = None
    max_epsilon_per_consumer: float | None = None
    budget_window_hours: float = 24.0
    min_rows: int | None = None
    min_key_bits: int | None = None
    approval: str = "auto"

    @classmethod
    def from_table(cls, raw: dict[str, Any]) -> StandingPolicy:
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(raw) - known):
            raise PolicyError(f"unknown policy keys {unknown}; known: {sorted(known)}")
        policy = cls(
            accept_from=tuple(raw.get("accept_from", ())),
            flows=tuple(raw.get("flows", KINDS)),
            max_epsilon_per_release=_positive(raw, "max_epsilon_per_release"),
            max_epsilon_per_day=_positive(raw, "max_epsilon_per_day"),
            max_epsilon_per_consumer=_positive(raw, "max_epsilon_per_consumer"),
            budget_window_hours=_positive(raw, "budget_window_hours") or 24.0,
            min_rows=raw.get("min_rows"),
            min_key_bits=raw.get("min_key_bits"),
            approval=raw.get("approval", "auto"),
        )
        if bad := sorted(set(policy.flows) - set(KINDS)):
            raise PolicyError(f"policy.flows: unknown kinds {bad}; known: {list(KINDS)}")
        if policy.approval not in ("auto", "manual"):
            raise PolicyError(f"policy.approval must be auto or manual, not {policy.approval!r}")
        try:
            policy.window_rule()
        except ValueError as error:
            raise PolicyError(f"policy's budget window: {error}") from None
        return policy

    def violations(
        self, kind: str, spec: dict[str, Any], spent_today: dict[str, float] | None = None
    ) -> list[str]:
        """Each rule the job ``spec`` (of ``kind``) breaks at this party, as a sentence.

        ``spent_today``: epsilon charged in the last 24 h per table this party releases from
        in the job (for ``max_epsilon_per_day``); ``None`` where this party releases nothing
        in the job (a features party): the epsilon rules are then not its to apply."""
        found = []
        if kind not in self.flows:
            found.append(f"policy.flows {list(self.flows)} does not include {kind!r}")
        for group in _RELEASES.get(kind, ()) if spent_today is not None else ():
            epsilon = (spec.get(group) or {}).get("epsilon")
            if epsilon is None:
                continue
            if self.max_epsilon_per_release is not None and epsilon > self.max_epsilon_per_release:
                found.append(
                    f"{group}.epsilon {epsilon:g} exceeds policy.max_epsilon_per_release "
                    f"{self.max_epsilon_per_release:g}"
                )
            for table, spent in spent_today.items():
                cap = self.max_epsilon_per_day
                if cap is not None and spent + epsilon > cap:
                    found.append(
                        f"{group}.epsilon {epsilon:g} on table {table!r} after {spent:g} spent "
                        f"in the last 24 h exceeds policy.max_epsilon_per_day {cap:g}"
                    )
        min_rows = (spec.get("psi") or {}).get("min_rows", 100)
        if self.min_rows is not None and "psi" in _groups(kind) and min_rows < self.min_rows:
            found.append(f"psi.min_rows {min_rows} is below policy.min_rows {self.min_rows}")
        for group in _KEYS.get(kind, ()):
            options = spec.get(group)
            bits = (options or {}).get("key_size", 2048)
            if options is not None and self.min_key_bits and bits < self.min_key_bits:
                found.append(
                    f"{group}.key_size {bits} is below policy.min_key_bits {self.min_key_bits}"
                )
        return found

    def window_rule(self) -> WindowRule | None:
        """The ledger's window rule this policy asks for (None: it sets no window cap)."""
        if self.max_epsilon_per_day is None and self.max_epsilon_per_consumer is None:
            return None  # before the ledger's import: `job status` reads a policy, not a ledger
        from storage.ledger import WindowRule  # the ledger enforces it; the policy only names it

        seconds = self.budget_window_hours * 3600
        return WindowRule(self.max_epsilon_per_day, self.max_epsilon_per_consumer, seconds)

    def accepts_proposals_from(self, peer: str) -> bool:
        return peer in self.accept_from


def _groups(kind: str) -> Iterable[str]:
    return ("psi",) if kind in ("main", "label_dp") else ()


def _positive(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or value <= 0:
        raise PolicyError(f"policy.{key} must be a number > 0, not {value!r}")
    return float(value)


def epsilon_spent_since(spends: Iterable[dict[str, Any]], hours: float = 24) -> float:
    """Epsilon charged in the ledger's rows (``PrivacyLedger.spends``) in the last ``hours``."""
    since = datetime.now(UTC) - timedelta(hours=hours)
    total = 0.0
    for row in spends:
        created = row.get("created_at")
        if isinstance(created, datetime) and created.tzinfo is None:
            created = created.replace(tzinfo=UTC)
        if created is None or created >= since:
            total += float(row.get("epsilon", 0.0))
    return total
