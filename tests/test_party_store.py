"""Importing a party's table: every validation error names table, column and first bad row,
and leaves the database exactly as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from storage import party_store
from storage.descriptor import DescriptorError, TableRef
from storage.party_store import PartyStore
from storage.validation import DataValidationError


def good_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "id": [10, 11, 12, 13],
            "y": [0, 1, 1, 0],
            "age": [30.0, 41.5, 52.0, 29.0],
            "score": [0.1, 0.2, 0.3, 0.4],
        }
    )


@pytest.fixture
def ref(tmp_path: Path) -> TableRef:
    return TableRef(
        database=str(tmp_path / "bank.duckdb"),
        table="customers",
        id_column="id",
        label_column="y",
        label_domain=(0, 1),
    )


def test_import_and_read_back(ref: TableRef) -> None:
    store = PartyStore.of(ref)
    assert store.import_frame(good_frame(), ref) == 4
    frame = store.read_table(ref)
    assert list(frame.columns) == ["id", "y", "age", "score"]
    assert frame["age"].tolist() == [30.0, 41.5, 52.0, 29.0]
    assert ref.party == "bank"


def test_reimport_replaces_rather_than_duplicates(ref: TableRef) -> None:
    store = PartyStore.of(ref)
    store.import_frame(good_frame(), ref)
    store.import_frame(good_frame(), ref)
    assert len(store.read_table(ref)) == 4


def test_csv_and_parquet_sources(ref: TableRef, tmp_path: Path) -> None:
    store = PartyStore.of(ref)
    good_frame().to_csv(tmp_path / "a.csv", index=False)
    good_frame().to_parquet(tmp_path / "a.parquet")
    assert store.import_file(tmp_path / "a.csv", ref) == 4
    assert store.import_file(tmp_path / "a.parquet", ref) == 4
    with pytest.raises(ValueError, match=r"only \.csv"):
        store.import_file(tmp_path / "a.xlsx", ref)


def _corrupt(column: str, row: int, value: object) -> pd.DataFrame:
    frame = good_frame().astype({column: object})
    frame.loc[row, column] = value
    return frame


@pytest.mark.parametrize(
    ("frame", "column", "row", "problem"),
    [
        (good_frame().drop(columns="y"), "y", None, "column is missing"),
        (good_frame().iloc[0:0], None, None, "table is empty"),
        (_corrupt("id", 2, None), "id", 3, "id is null"),
        (_corrupt("id", 3, 11), "id", 4, "duplicate id"),
        (_corrupt("id", 3, "11"), "id", 4, "duplicate id"),
        (_corrupt("age", 1, "forty"), "age", 2, "'forty' is not numeric"),
        (_corrupt("age", 2, np.nan), "age", 3, "missing"),
        (_corrupt("score", 0, np.inf), "score", 1, "infinite"),
        (_corrupt("y", 3, 2), "y", 4, "outside the declared domain"),
        (_corrupt("y", 1, np.nan), "y", 2, "missing"),
    ],
)
def test_bad_input_is_refused_and_nothing_changes(
    ref: TableRef, frame: pd.DataFrame, column: str | None, row: int | None, problem: str
) -> None:
    store = PartyStore.of(ref)
    store.import_frame(good_frame(), ref)
    before = store.fingerprint(ref)
    with pytest.raises(DataValidationError) as caught:
        store.import_frame(frame, ref)
    message = str(caught.value)
    assert "table 'customers'" in message and problem in message
    if column is not None:
        assert f"column {column!r}" in message
    if row is not None:
        assert f"row {row}" in message
    assert (caught.value.column, caught.value.row) == (column, row)
    assert store.fingerprint(ref) == before


def test_bad_first_import_creates_no_table(ref: TableRef) -> None:
    store = PartyStore.of(ref)
    with pytest.raises(DataValidationError):
        store.import_frame(_corrupt("age", 0, "n/a"), ref)
    assert not store.has_table("customers")


def test_explicit_feature_columns_must_exist(tmp_path: Path) -> None:
    ref = TableRef(database=str(tmp_path / "p.duckdb"), table="t", feature_columns=("age", "zip"))
    with pytest.raises(DataValidationError, match=r"column 'zip'.*missing"):
        PartyStore.of(ref).import_frame(good_frame(), ref)


def test_descriptor_round_trip_and_identifier_checks(ref: TableRef) -> None:
    assert TableRef.from_dict(ref.to_dict()) == ref
    assert TableRef.from_json('{"database": "x.duckdb", "table": "t"}').party == "x"
    with pytest.raises(DescriptorError, match="plain identifier"):
        TableRef(database="x.duckdb", table="t; DROP TABLE t")
    with pytest.raises(DescriptorError, match="unknown descriptor keys"):
        TableRef.from_dict({"database": "x.duckdb", "table": "t", "colour": 1})


def test_fingerprint_read_in_pieces_equals_the_whole_table_hashed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = TableRef(database=str(tmp_path / "p.duckdb"), table="t", label_column="y")
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"id": [f"c-{i}" for i in range(1000)], "y": rng.integers(0, 2, 1000)})
    frame["age"] = rng.normal(size=1000)
    frame.loc[[3, 700], "age"] = np.nan  # a missing feature cell (a job that imputes)
    store = PartyStore.of(ref)
    store.write_table("t", frame)
    whole = store.read_table(ref, allow_missing=True)  # the digest as it was defined
    expected = hashlib.sha256(pd.util.hash_pandas_object(whole, index=False).to_numpy().tobytes())
    expected.update(",".join(whole.columns).encode())
    monkeypatch.setattr(party_store, "CHUNK_ROWS", 64)  # 16 pieces
    assert store.fingerprint(ref) == expected.hexdigest()
    frame.loc[999, "age"] = 1.0
    store.write_table("t", frame)
    assert store.fingerprint(ref) != expected.hexdigest()
