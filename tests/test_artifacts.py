"""A party's artifact table: several artifacts in one statement, and its schema checked once
per held session, never taken as there when the transaction that made it rolled back."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import artifacts
from storage.artifacts import Artifact, ArtifactStore
from storage.party_store import PartyStore


@pytest.fixture
def store(tmp_path: Path) -> PartyStore:
    store = PartyStore(tmp_path / "party.duckdb")
    with store.connect():  # the database exists, without the artifact table
        pass
    return store


def test_put_many_writes_every_item_and_refuses_a_key_twice(store: PartyStore) -> None:
    shelf = ArtifactStore(store)
    shelf.put_many([Artifact("a", {"w": [1.5]}, "state"), Artifact("b", 7, "mark")])
    assert shelf.get("a") == {"w": [1.5]} and shelf.get("b") == 7
    shelf.put_many([Artifact("a", 2, "state")])  # replaces
    assert [key for key, *_ in shelf.list()] == ["a", "b"] and shelf.get("a") == 2
    with pytest.raises(ValueError, match="twice"):
        shelf.put_many([Artifact("c", 1, "x"), Artifact("c", 2, "x")])
    assert shelf.get("c") is None  # nothing written


def test_a_rolled_back_table_is_not_taken_as_there(store: PartyStore) -> None:
    shelf = ArtifactStore(store)
    with store.session():
        with pytest.raises(RuntimeError), store.transaction() as con:
            shelf.put("first", 1, "state", con)  # creates the table in this transaction
            raise RuntimeError("the step fails: everything rolls back")
        assert shelf.get("first") is None  # the table is made again, not assumed
        shelf.put("second", 2, "state")
        assert shelf.get("second") == 2


def test_the_schema_is_checked_once_per_held_session(
    store: PartyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shelf = ArtifactStore(store)
    with store.session():
        shelf.put("a", 1, "state")  # creates the table, committed
        shelf.get("a")  # seen committed by a fresh connection
        monkeypatch.setattr(artifacts, "_SCHEMA", "NOT SQL")  # any further check would fail
        with store.transaction() as con:
            shelf.put_many([Artifact("b", 2, "state"), Artifact("c", 3, "state")], con)
        assert shelf.get("b") == 2 and shelf.get("c") == 3
    with pytest.raises(Exception, match="syntax"), store.session():  # a new one checks again
        shelf.get("a")
