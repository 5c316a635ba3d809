"""The per-flow-run feature cache: one read per run, fresh data in the next run, read-only.

The run id is set directly (the flows' own tests run the cache inside real flow runs)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import feature_cache


def _store(ref: TableRef, scale: float) -> None:
    frame = pd.DataFrame({"id": [1, 2, 3], "a": [0.5, -4.0, 2.0], "b": [1.0, 2.0, 9.0]})
    frame[["a", "b"]] *= scale
    PartyStore.of(ref).import_frame(frame, ref)


def test_one_read_per_flow_run_and_fresh_data_in_the_next(tmp_path, monkeypatch):
    ref = TableRef(str(tmp_path / "host.duckdb"), "host")
    _store(ref, 1.0)
    monkeypatch.setattr(feature_cache.flow_run, "get_id", lambda: "run-1")
    first = feature_cache.party_features(ref, 3.0)
    assert feature_cache.party_features(ref, 3.0) is first  # no second read in the run
    assert feature_cache.party_features(ref, None) is not first  # another clip, another entry
    assert first.names == ("a", "b")
    assert np.array_equal(first.X, [[0.5, 1.0], [-3.0, 2.0], [2.0, 3.0]])  # clipped at 3
    with pytest.raises(ValueError):
        first.X[0, 0] = 1.0  # shared by every step of the run: read-only
    _store(ref, 2.0)  # the owner replaces the table between runs
    monkeypatch.setattr(feature_cache.flow_run, "get_id", lambda: "run-2")
    second = feature_cache.party_features(ref, 3.0)
    assert np.array_equal(second.X, [[1.0, 2.0], [-3.0, 3.0], [3.0, 3.0]])
    monkeypatch.setattr(feature_cache.flow_run, "get_id", lambda: None)  # outside a flow run
    assert feature_cache.party_features(ref, 3.0) is not feature_cache.party_features(ref, 3.0)
    feature_cache.clear()
