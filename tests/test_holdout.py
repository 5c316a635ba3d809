"""The one hold-out rule: every party derives the same rows from public values, the rows do
not depend on the table's order, and every flow's split is this rule."""

from __future__ import annotations

import numpy as np
import pytest

from core.holdout import seeded_holdout_rows
from core.vertical_lr.schedule import Schedule
from tasks.summaries import holdout_split


@pytest.mark.parametrize(("rows", "fraction"), [(10, 0.2), (569, 0.2), (1000, 0.1), (7, 0.0)])
def test_same_public_seed_same_rows_and_the_promised_count(rows: int, fraction: float) -> None:
    first = seeded_holdout_rows(rows, fraction, 42)
    assert np.array_equal(first, seeded_holdout_rows(rows, fraction, 42))
    assert len(first) == round(rows * fraction) == len(np.unique(first))
    assert np.all(np.diff(first) > 0) and (len(first) == 0 or 0 <= first[0] <= first[-1] < rows)


def test_rows_are_drawn_not_taken_by_position() -> None:
    labels = np.repeat([0, 1], 500)  # a table sorted by its label
    for seed in range(5):
        held_out = seeded_holdout_rows(len(labels), 0.2, seed)
        assert 0.4 <= labels[held_out].mean() <= 0.6
    assert not np.array_equal(seeded_holdout_rows(1000, 0.2, 0), seeded_holdout_rows(1000, 0.2, 1))


def test_enough_rows_are_kept_for_training() -> None:
    assert len(seeded_holdout_rows(5, 0.4, 3, keep_for_training=4)) == 1
    assert len(seeded_holdout_rows(3, 0.4, 3, keep_for_training=4)) == 0


def test_the_vertical_schedule_is_this_rule_and_the_job_id_split_partitions_rows() -> None:
    schedule = Schedule(300, 32, 9, 0.15)
    held_out = seeded_holdout_rows(300, 0.15, [9, 0])
    assert np.array_equal(schedule.holdout_rows, held_out)
    assert np.array_equal(schedule.train_rows, np.setdiff1d(np.arange(300), held_out))
    train, split_held_out = holdout_split(300, 0.15, "job-7")
    assert len(split_held_out) == 45 and not np.intersect1d(train, split_held_out).size
    assert np.array_equal(np.union1d(train, split_held_out), np.arange(300))
