"""A party's saved models: one key scheme, which rows trained them, and the promoted one.

Keys are ``models/<flow>/<job id>`` for a model a party holds whole and
``models/<flow>/<job id>/<party>`` for one party's share of a split model (vertical LR). Each
model's training rows are kept beside it (``privreg_model_rows``: id, held out or not), so
scores can say which rows the model saw. Scoring never picks a model by age: it uses the model
*promoted* for a job and flow (``models/promoted/<job>/<flow>``), which ``privreg models
promote`` or the job's pipeline sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

import duckdb
import pandas as pd

from core.ids import canonical_id
from core.model_format import FLOWS, ModelFormatError, ModelRecord
from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore

KIND = "model"
_PROMOTED = "models/promoted/"
_ROWS = """
CREATE TABLE IF NOT EXISTS privreg_model_rows (
    model_key VARCHAR NOT NULL,
    id VARCHAR NOT NULL,
    held_out BOOLEAN NOT NULL
)
"""


class NoPromotedModelError(ValueError):
    """Scoring was asked for a job's model and none is promoted (names the command to run)."""


def model_key(flow: str, job_id: str, party: str | None = None) -> str:
    """Where a model lives in its holder's store (``party``: a share of a split model)."""
    if flow not in FLOWS:
        raise ModelFormatError(f"unknown flow {flow!r} (one of {', '.join(FLOWS)})")
    return "/".join(["models", flow, job_id, *([party] if party else [])])


def promotion_key(job: str, flow: str) -> str:
    return f"{_PROMOTED}{job}/{flow}"


@dataclass(frozen=True)
class ModelListing:
    """One line of ``privreg models list``."""

    key: str
    flow: str
    job: str
    job_id: str
    created: str
    promoted_for: tuple[str, ...]  # the jobs whose scoring uses it
    bytes: int
    saved_at: datetime


def _text_ids(ids: Sequence[object]) -> list[str]:
    return [canonical_id(i).decode() for i in ids]


class ModelStore:
    """The models in one party's own store."""

    def __init__(self, store: PartyStore) -> None:
        self.store = store
        self.artifacts = ArtifactStore(store)

    def save(
        self,
        key: str,
        record: ModelRecord,
        train_ids: Sequence[object] = (),
        held_out_ids: Sequence[object] = (),
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> None:
        """Store ``record`` under ``key`` with the ids it trained on and held out, replacing
        a previous save of the same key; joins the caller's transaction when given one. A
        record that does not count its rows gets the ids' counts, so its export says them."""
        if not record.rows and (len(train_ids) or len(held_out_ids)):
            record = replace(record, rows={"train": len(train_ids), "held_out": len(held_out_ids)})
        if con is None:
            with self.store.transaction() as own:
                self.save(key, record, train_ids, held_out_ids, own)
            return
        self.artifacts.put(key, record.to_dict(), KIND, con=con)
        con.execute(_ROWS)
        con.execute("DELETE FROM privreg_model_rows WHERE model_key = ?", [key])
        frame = pd.DataFrame(
            {
                "model_key": key,
                "id": _text_ids(train_ids) + _text_ids(held_out_ids),
                "held_out": [False] * len(train_ids) + [True] * len(held_out_ids),
            }
        )
        if len(frame):
            con.register("_privreg_model_rows", frame)
            try:
                con.execute("INSERT INTO privreg_model_rows SELECT * FROM _privreg_model_rows")
            finally:
                con.unregister("_privreg_model_rows")

    def load(self, key: str) -> ModelRecord:
        record = self.artifacts.get(key)
        if record is None:
            raise KeyError(
                f"no model {key!r} in {self.store.path.name} (privreg models list shows them)"
            )
        return ModelRecord.from_dict(record)

    def list(self) -> list[ModelListing]:
        """Every model in the store, oldest first, with the jobs it is promoted for."""
        promoted: dict[str, list[str]] = {}
        with self.store.session():
            for key, kind, _, _ in self.artifacts.list(_PROMOTED):
                if kind == "promotion":
                    job = key.removeprefix(_PROMOTED).rsplit("/", 1)[0]
                    promoted.setdefault(self.artifacts.get(key), []).append(job)
            listings = []
            for key, kind, size, saved_at in self.artifacts.list("models/"):
                if kind != KIND:
                    continue
                stored = self.artifacts.get(key)
                listings.append(
                    ModelListing(
                        key,
                        str(stored.get("flow", "?")),
                        str(stored.get("job", "")),
                        str(stored.get("job_id", "")),
                        str(stored.get("created", "")),
                        tuple(promoted.get(key, [])),
                        size,
                        saved_at,
                    )
                )
        return sorted(listings, key=lambda m: (m.saved_at, m.key))

    def promote(self, key: str, job: str | None = None) -> str:
        """Make ``key`` the model scoring uses for ``job`` (default: the model's own job) and
        its flow; returns the job it was promoted for."""
        record = self.load(key)
        job = job or record.job or record.job_id
        self.artifacts.put(promotion_key(job, record.flow), key, "promotion")
        return job

    def promoted(self, job: str, flow: str) -> tuple[str, ModelRecord]:
        """The key and record of the model promoted for ``job`` and ``flow``."""
        key = self.artifacts.get(promotion_key(job, flow))
        if key is None:
            raise NoPromotedModelError(
                f"no {flow} model is promoted for job {job!r} in {self.store.path.name}: run "
                f"privreg models promote --database {self.store.path} --key <key> --job {job} "
                "(privreg models list shows the keys)"
            )
        return key, self.load(key)

    def row_roles(self, key: str, ids: Sequence[object]) -> list[str | None]:
        """For each id: ``"train"``, ``"held out"`` (by the model ``key``'s training) or None
        (a row its training never saw, or a model saved without its rows)."""
        with self.store.connect() as con:
            con.execute(_ROWS)
            rows = con.execute(
                "SELECT id, held_out FROM privreg_model_rows WHERE model_key = ?", [key]
            ).fetchall()
        roles = {i: ("held out" if held else "train") for i, held in rows}
        return [roles.get(i) for i in _text_ids(ids)]
