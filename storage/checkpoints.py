"""Per-party round checkpoints for iterative protocols.

Each party saves its own state after each finished round, in its own database. A run that
resumes asks every party for its last finished round and restarts after the *smallest*; a
party that got further (it finished a round the others did not) rolls back, so no round is
ever half committed across parties.
"""

from __future__ import annotations

from typing import Any

import duckdb

from storage.artifacts import Artifact, ArtifactStore
from storage.party_store import PartyStore


class RoundCheckpoints:
    """Round states of one party in one job of one protocol."""

    def __init__(self, store: PartyStore, protocol: str, job_id: str) -> None:
        self.artifacts = ArtifactStore(store)
        self.prefix = f"{protocol}/{job_id}/round/"

    def _key(self, round_: int) -> str:
        return f"{self.prefix}{round_:07d}"

    def save(
        self, round_: int, state: dict[str, Any], con: duckdb.DuckDBPyConnection | None = None
    ) -> None:
        """Store the round's state; joins the caller's transaction when ``con`` is given."""
        self.artifacts.put_many([self.item(round_, state)], con=con)

    def item(self, round_: int, state: dict[str, Any]) -> Artifact:
        """The round's state, to write with other artifacts in one statement."""
        return Artifact(self._key(round_), state, "round-state")

    def rounds(self, con: duckdb.DuckDBPyConnection | None = None) -> list[int]:
        return [int(key.rsplit("/", 1)[1]) for key, *_ in self.artifacts.list(self.prefix, con)]

    def last_round(self) -> int:
        """The last finished round, or -1 when none is stored."""
        rounds = self.rounds()
        return max(rounds) if rounds else -1

    def load(self, round_: int) -> dict[str, Any]:
        state = self.find(round_)
        if state is None:
            raise KeyError(f"no checkpoint for round {round_} under {self.prefix}")
        return state

    def find(self, round_: int) -> dict[str, Any] | None:
        """The round's state, None if it is not stored (one lookup, not a listing)."""
        return self.artifacts.get(self._key(round_))

    def prune(self, keep_last: int = 2, con: duckdb.DuckDBPyConnection | None = None) -> None:
        """Keep only the most recent rounds (older ones are never needed to resume); joins the
        caller's transaction when ``con`` is given (e.g. the one that saves the newest round)."""
        if con is None:
            with self.artifacts.store.transaction() as own:
                self.prune(keep_last, own)
            return
        for r in sorted(self.rounds(con))[:-keep_last]:
            self.artifacts.delete_prefix(self._key(r), con=con)
