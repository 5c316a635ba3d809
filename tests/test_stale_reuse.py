"""A stored alignment is reused only for the tables it came from: after a party reloads its
table, a re-run re-aligns (one process) or refuses naming the table and the job (an agreed job
id), and never hands back the old rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from prefect.logging import disable_run_logger

from flows.align import psi_align
from storage.descriptor import TableRef
from storage.lineage import StaleResultError
from storage.party_store import PartyStore
from tasks import psi as steps

pytestmark = pytest.mark.usefixtures("prefect_server")


def _load(ref: TableRef, ids: np.ndarray, values: np.ndarray) -> None:
    frame = pd.DataFrame({"id": ids, "y": (values > 0).astype(int), "x": values})
    PartyStore.of(ref).import_frame(frame, ref)


def _aligned(result: dict, index: int) -> pd.DataFrame:
    ref = TableRef.from_dict(result["aligned"][index])
    return PartyStore.of(ref).read_table(ref)


def test_a_changed_table_is_realigned_or_refused_never_reused(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    guest = TableRef(str(tmp_path / "clinic.duckdb"), "patients", label_column="y")
    host = TableRef(str(tmp_path / "lab.duckdb"), "tests")
    ids = np.arange(60)
    first, second = rng.normal(size=60), rng.normal(size=60) + 10.0
    _load(host, ids[10:], rng.normal(size=50))

    def align() -> dict:
        return psi_align(guest.to_dict(), host.to_dict(), min_rows=10, workspace=str(tmp_path))

    def shared(values: np.ndarray) -> dict[int, float]:  # the guest's rows of ids 10..59
        return dict(zip(ids[10:].tolist(), values[10:].tolist(), strict=True))

    def guest_values(result: dict) -> dict[int, float]:
        rows = _aligned(result, 0)
        return dict(zip(rows["id"].tolist(), rows["x"].tolist(), strict=True))

    _load(guest, ids, first)
    one = align()
    assert not one["reused"] and guest_values(one) == shared(first)
    assert align()["reused"]  # unchanged: the same job's alignment

    _load(guest, ids, second)  # the guest reloads its table: same ids, new values
    two = align()
    assert two["job_id"] != one["job_id"] and not two["reused"]
    assert guest_values(two) == shared(second)

    _load(guest, ids, first)  # back to the first values: the first job's id again, but its
    three = align()  # aligned copy now holds the second job's rows, so it is not reused
    assert not three["reused"] and three["job_id"] not in (one["job_id"], two["job_id"])
    assert guest_values(three) == shared(first)

    # an agreed job id (a party's side, psi_align_party) cannot move: it refuses instead
    with disable_run_logger():
        assert steps.stored_alignment.fn(guest, three["job_id"]) is not None
        _load(guest, ids, second)
        with pytest.raises(StaleResultError) as refused:
            steps.stored_alignment.fn(guest, three["job_id"])
    message = str(refused.value)
    assert "table 'patients' changed" in message and three["job_id"] in message
    assert "new run" in message
