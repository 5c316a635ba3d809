"""Loads that cannot silently go wrong: huge values keep their information, a file that cannot
be read names itself and what to do, and an existing table is replaced or appended to only
when the owner says so; every refusal leaves the database byte for byte as it was."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core import preprocessing as pp
from core.horizontal_lr import centralized_gd
from privreg.cli import main
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.validation import DataValidationError


def _digest(database: Path) -> str:
    """The database's bytes (and its write-ahead log's, if one is left)."""
    files = (database, database.with_name(database.name + ".wal"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files if f.exists())).hexdigest()


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The CLI's one error line for ``argv`` (status 1, no traceback)."""
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _trained(ref: TableRef, spec: pp.PreprocessingSpec) -> tuple[np.ndarray, np.ndarray]:
    """The stored table's standardised design matrix and a plain logistic regression on it."""
    frame = PartyStore.of(ref).read_table(ref)
    X = frame[["x"]].to_numpy(dtype=float)
    Z = pp.fit_local(X, ["x"], spec).transform(X, f"table {ref.table!r}")
    return Z, centralized_gd(Z, frame["y"].to_numpy(), l2=0.01, learning_rate=0.5, iterations=200)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no overflow, not even a warning
@pytest.mark.parametrize("scaling", ["standard", "robust"])
def test_a_1e308_column_trains_like_the_same_column_divided_by_1e300(
    tmp_path: Path, scaling: str
) -> None:
    rng = np.random.default_rng(3)
    signal = rng.normal(size=40)
    labels = (signal + rng.normal(size=40) > 0).astype(int)
    huge = 1e308 + 1e307 * signal  # its sum (and every square) overflows a float
    refs = {}
    for name, x in (("huge", huge), ("tame", huge / 1e300)):
        refs[name] = TableRef(str(tmp_path / "p.duckdb"), name, label_column="y")
        frame = pd.DataFrame({"id": range(40), "y": labels, "x": x})
        PartyStore.of(refs[name]).import_frame(frame, refs[name])
    spec = pp.PreprocessingSpec(scaling=scaling)
    Z_huge, w_huge = _trained(refs["huge"], spec)
    Z_tame, w_tame = _trained(refs["tame"], spec)
    np.testing.assert_allclose(Z_huge, Z_tame, rtol=1e-12, atol=1e-12)
    assert abs(w_tame[0]) > 0.5  # the feature carries the label's signal
    assert w_huge[0] == pytest.approx(w_tame[0], rel=1e-9)


@pytest.mark.parametrize(
    ("x", "where", "problem"),
    [
        ([1.5e308, 0.0, -1.5e308, 1.0], "row 3 (id 'c')", "further from row 1's 1.5e+308 than"),
        ([1.0, float("inf"), 2.0, 3.0], "row 2 (id 'b')", "feature is infinite"),
    ],
)
def test_a_value_that_would_overflow_is_refused_at_load(
    tmp_path: Path, x: list[float], where: str, problem: str
) -> None:
    ref = TableRef(str(tmp_path / "p.duckdb"), "t")
    store = PartyStore.of(ref)
    store.import_frame(pd.DataFrame({"id": ["a", "b"], "x": [1.0, 2.0]}), ref)
    before = _digest(store.path)
    with pytest.raises(DataValidationError) as refused:
        store.import_frame(pd.DataFrame({"id": ["a", "b", "c", "d"], "x": x}), ref)
    assert f"table 't', column 'x', {where}: " in str(refused.value)
    assert problem in str(refused.value)
    assert _digest(store.path) == before


def test_a_scaled_cell_beyond_a_float_is_refused_and_a_far_one_still_scales() -> None:
    """Robust scaling of a column whose quartiles lie 1e-11 apart would put its 1e308 at
    1e319: refused naming the row, never passed on as inf. A new row far beyond the fitted
    centre (whose difference to it overflows) is scaled all the same."""
    column = np.array([0.0, 1e-11] * 10 + [1e308])[:, None]
    fitted = pp.fit_local(column, ["x"], pp.PreprocessingSpec(scaling="robust"))
    with pytest.raises(pp.PreprocessingError, match=r"^party p, column 'x', row 21: value 1e\+308"):
        fitted.transform(column, "party p")
    huge = 1e308 + 1e307 * np.arange(5.0)[:, None]
    fitted = pp.fit_local(huge, ["x"], pp.PreprocessingSpec())
    (center, scale) = fitted.columns[0].center, fitted.columns[0].scale
    far = fitted.transform(np.array([[-1.5e308]]))
    assert far[0, 0] == pytest.approx(-1.5e308 / scale - center / scale, rel=1e-12)


def _latin1(path: Path) -> None:
    path.write_bytes("id,x\n1,0.5\n2,caf\xe9\n".encode("latin-1"))


def _gzipped_latin1(path: Path) -> None:
    path.write_bytes(gzip.compress("id,x\n1,0.5\n2,caf\xe9\n".encode("latin-1")))


BAD_FILES = {
    "latin1.csv": (_latin1, "line 3 is not UTF-8 (byte 0xe9); re-save it as UTF-8"),
    "latin1.csv.gz": (_gzipped_latin1, "line 3 is not UTF-8 (byte 0xe9); re-save it as UTF-8"),
    "empty.csv": (lambda p: p.write_text(""), "the file is empty"),
    "empty.parquet": (lambda p: p.write_bytes(b""), "the file is empty"),
    "header.csv": (lambda p: p.write_text("id,x\n"), "the file has a header but no rows"),
    "long.csv": (
        lambda p: p.write_text("id,x\n1,0.5\n2,0.7,9\n"),
        "line 3 has 3 fields where the header has 2",
    ),
    "short.csv": (
        lambda p: p.write_text("id,x,z\n1,0.5,1\n2,0.7\n3,0.1,2\n"),
        "line 3 has 2 fields where the header has 3",
    ),
    "shifted.csv": (  # pandas would make the ids an index and shift every column left
        lambda p: p.write_text("id,x\n1,0.5,9\n2,0.7,8\n"),
        "line 2 has 3 fields where the header has 2",
    ),
    "absent.csv": (lambda p: None, "no such file"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_file_names_itself_says_what_to_do_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    database = tmp_path / "shop.duckdb"
    good = tmp_path / "good.csv"
    good.write_text("id,x,z\n1,0.5,1\n2,0.7,2\n")
    assert main(["load", str(good), "--database", str(database), "--table", "orders"]) == 0
    before = _digest(database)
    write, message = BAD_FILES[name]
    write(tmp_path / name)
    argv = ["load", str(tmp_path / name), "--database", str(database), "--table", "orders"]
    line = _error_line(capsys, [*argv, "--replace"])
    assert line.startswith(f"privreg: error: table 'orders': file {tmp_path / name}: ")
    assert message in line
    assert _digest(database) == before


def _csv(path: Path, ids: list[object], x: list[float]) -> str:
    pd.DataFrame({"id": ids, "x": x}).to_csv(path, index=False)
    return str(path)


def test_an_existing_table_is_replaced_or_appended_to_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = tmp_path / "shop.duckdb"
    ref = TableRef(str(database), "orders")
    load = ["--database", str(database), "--table", "orders"]
    first = _csv(tmp_path / "first.csv", [1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.4, 0.5])
    assert main(["load", first, *load]) == 0
    assert capsys.readouterr().out.startswith("5 rows loaded into orders")
    before = _digest(database)

    second = _csv(tmp_path / "second.csv", [7, 8, 9], [0.7, 0.8, 0.9])
    assert _error_line(capsys, ["load", second, *load]) == (
        "privreg: error: table 'orders': already exists in shop.duckdb (5 rows); privreg load "
        "--replace replaces it, --append adds the file's rows to it"
    )
    assert _digest(database) == before

    assert main(["load", second, *load, "--replace"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "replaced orders: 5 rows -> 3 rows"
    assert PartyStore.of(ref).read_table(ref)["id"].tolist() == [7, 8, 9]

    third = _csv(tmp_path / "third.csv", [10, 11], [1.0, 1.1])
    assert main(["load", third, *load, "--append"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "appended 2 rows to orders: 3 rows -> 5 rows"
    stored = PartyStore.of(ref).read_table(ref)
    assert stored["id"].tolist() == [7, 8, 9, 10, 11]
    assert stored["x"].tolist() == [0.7, 0.8, 0.9, 1.0, 1.1]


@pytest.mark.parametrize(
    ("ids", "x", "expected"),
    [
        (  # the first id the table holds already, by its row in the file and in the table
            [12, 9, 8],
            [0.1, 0.2, 0.3],
            "table 'orders', column 'id', row 2 (id 9): the table holds this id already (its "
            "row 3); append adds new ids only",
        ),
        (  # the combined table (rows numbered after the stored ones) passes the same validation
            [12, 13],
            [0.1, -1.5e308],
            "table 'orders', column 'x', row 6 (id 13): feature -1.5e+308 is further from row "
            "4's 1.5e+308 than",
        ),
    ],
)
def test_append_refuses_what_the_combined_table_may_not_hold(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    ids: list[int],
    x: list[float],
    expected: str,
) -> None:
    database = tmp_path / "shop.duckdb"
    load = ["--database", str(database), "--table", "orders"]
    assert main(["load", _csv(tmp_path / "a.csv", [7, 8, 9, 10], [1, 2, 3, 1.5e308]), *load]) == 0
    before = _digest(database)
    line = _error_line(capsys, ["load", _csv(tmp_path / "b.csv", ids, x), *load, "--append"])
    assert line.startswith(f"privreg: error: {expected}")
    assert _digest(database) == before


def test_a_job_s_load_still_replaces_its_own_table(tmp_path: Path) -> None:
    """PartyStore.import_file's default (a job's load stage) replaces, as before."""
    ref = TableRef(str(tmp_path / "p.duckdb"), "orders")
    store = PartyStore.of(ref)
    assert store.import_file(_csv(tmp_path / "a.csv", [1, 2, 3], [0.1, 0.2, 0.3]), ref) == 3
    assert store.import_file(_csv(tmp_path / "b.csv", [4, 5], [0.4, 0.5]), ref) == 2
    assert store.read_table(ref)["id"].tolist() == [4, 5]
