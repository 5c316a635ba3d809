"""Horizontal logistic regression maths: gradients, federated = centralised, table validation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from core.horizontal_lr import (
    EmptyPartyError,
    InvalidFeatureError,
    InvalidLabelError,
    SchemaMismatchError,
    apply_mean_delta,
    apply_mean_gradient,
    centralized_gd,
    gradient,
    init_model,
    local_epochs,
    local_gradient,
    objective,
    party_arrays,
    train_federated,
    validate_party_tables,
)
from core.secagg import secure_sum, unpack_weighted

RNG = np.random.default_rng(7)
TRUE_WEIGHTS = np.array([1.5, -2.0, 0.5, 0.0, -0.3])  # 4 coefficients + intercept


def make_party(rows: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows from a logistic model; ``shift`` makes the parties' feature distributions differ."""
    X = RNG.normal(loc=shift, size=(rows, 4))
    y = (RNG.random(rows) < 1 / (1 + np.exp(-(X @ TRUE_WEIGHTS[:-1] + TRUE_WEIGHTS[-1])))) * 1.0
    return X, y


PARTIES = [make_party(60, -0.5), make_party(150, 0.0), make_party(90, 0.7)]
POOLED_X = np.vstack([X for X, _ in PARTIES])
POOLED_Y = np.concatenate([y for _, y in PARTIES])


def test_gradient_matches_central_finite_differences() -> None:
    weights = RNG.normal(size=5)
    X, y = PARTIES[1]
    step = 1e-6
    numeric = np.array(
        [
            (objective(weights + step * e, X, y, 0.1) - objective(weights - step * e, X, y, 0.1))
            / (2 * step)
            for e in np.eye(5)
        ]
    )
    assert np.allclose(gradient(weights, X, y, 0.1), numeric, rtol=1e-6, atol=1e-8)


def test_row_weighted_mean_of_party_gradients_is_the_pooled_gradient() -> None:
    weights = RNG.normal(size=5)
    updates = [local_gradient(weights, X, y, 0.05) for X, y in PARTIES]
    rows = np.array([u.n_rows for u in updates])
    mean_gradient = np.average([u.update for u in updates], axis=0, weights=rows)
    mean_loss = np.average([u.loss for u in updates], weights=rows)
    assert np.allclose(mean_gradient, gradient(weights, POOLED_X, POOLED_Y, 0.05), atol=1e-13)
    assert mean_loss == pytest.approx(objective(weights, POOLED_X, POOLED_Y, 0.05), abs=1e-13)


def test_packed_updates_summed_securely_give_the_weighted_means() -> None:
    weights = RNG.normal(size=5)
    updates = [local_gradient(weights, X, y, 0.0) for X, y in PARTIES]
    aggregate = unpack_weighted(secure_sum([u.packed() for u in updates]).total)
    assert aggregate.total_weight == pytest.approx(len(POOLED_Y), abs=1e-6)
    assert np.max(np.abs(aggregate.mean - gradient(weights, POOLED_X, POOLED_Y, 0.0))) < 1e-8
    assert aggregate.mean_loss == pytest.approx(objective(weights, POOLED_X, POOLED_Y, 0.0))


def test_secure_gradient_averaging_matches_centralized_gd() -> None:
    iterations, learning_rate, l2 = 40, 0.5, 0.01
    fit = train_federated(PARTIES, iterations, learning_rate, l2)
    central = centralized_gd(POOLED_X, POOLED_Y, l2, learning_rate, iterations)
    assert np.max(np.abs(fit.weights - central)) < 1e-6
    assert fit.losses[0] == pytest.approx(np.log(2.0), abs=1e-6)  # zero model: p = 1/2
    assert fit.losses[-1] < fit.losses[0] - 0.1
    assert fit.losses[-1] == pytest.approx(
        objective(
            centralized_gd(POOLED_X, POOLED_Y, l2, learning_rate, iterations - 1),
            POOLED_X,
            POOLED_Y,
            l2,
        ),
        abs=1e-6,
    )


def test_fedavg_with_one_local_epoch_is_one_gradient_step() -> None:
    weights = RNG.normal(size=5)
    updates = [local_epochs(weights, X, y, 0.02, 0.3, epochs=1) for X, y in PARTIES]
    rows = [u.n_rows for u in updates]
    mean_delta = np.average([u.update for u in updates], axis=0, weights=rows)
    expected = apply_mean_gradient(weights, gradient(weights, POOLED_X, POOLED_Y, 0.02), 0.3)
    assert np.allclose(apply_mean_delta(weights, mean_delta), expected, atol=1e-13)


def test_fedavg_training_reduces_the_pooled_objective() -> None:
    fit = train_federated(PARTIES, iterations=10, learning_rate=0.5, l2=0.01, epochs_per_round=3)
    start = objective(init_model(4), POOLED_X, POOLED_Y, 0.01)
    assert objective(fit.weights, POOLED_X, POOLED_Y, 0.01) < start - 0.1


# --- validation of party tables -------------------------------------------------------------


def table(rows: int = 6, start_id: int = 0) -> pd.DataFrame:
    data = RNG.normal(size=(rows, 3))
    frame = pd.DataFrame(data, columns=["x0", "x1", "x2"])
    frame.insert(0, "y", np.arange(rows) % 2)
    frame.insert(0, "id", np.arange(start_id, start_id + rows))
    return frame


def test_valid_tables_give_the_features_and_aligned_arrays() -> None:
    guest, host = table(), table(start_id=100)
    host = host[["id", "x2", "y", "x0", "x1"]]  # same columns, other order
    features = validate_party_tables({"guest": guest, "host": host})
    assert features == ["x0", "x1", "x2"]
    X, y = party_arrays(host, features)
    assert np.array_equal(X[:, 2], host["x2"].to_numpy())
    assert np.array_equal(y, host["y"].to_numpy())


def test_missing_column_names_party_and_column() -> None:
    host = table().drop(columns=["x1"])
    with pytest.raises(SchemaMismatchError, match=r"party 'host': column 'x1' is missing") as info:
        validate_party_tables({"guest": table(), "host": host})
    assert (info.value.party, info.value.column) == ("host", "x1")


def test_extra_column_and_missing_label_are_schema_errors() -> None:
    with pytest.raises(SchemaMismatchError, match="'x9'"):
        validate_party_tables({"guest": table(), "host": table().assign(x9=1.0)})
    with pytest.raises(SchemaMismatchError, match="label column 'y'"):
        validate_party_tables({"guest": table(), "host": table().drop(columns=["y"])})


def test_empty_party_is_refused() -> None:
    with pytest.raises(EmptyPartyError, match="'host'"):
        validate_party_tables({"guest": table(), "host": table(rows=0)})


def test_label_outside_zero_one_names_party_column_and_first_row() -> None:
    host = table(start_id=500)
    host.loc[3, "y"] = 2
    host.loc[5, "y"] = -1
    where = r"party 'host', column 'y', row 3 \(id=503\): label 2 is not 0 or 1"
    with pytest.raises(InvalidLabelError, match=where) as info:
        validate_party_tables({"guest": table(), "host": host})
    assert info.value.row == 3


def test_non_numeric_or_missing_feature_names_first_row() -> None:
    host = table().astype({"x1": object})
    host.loc[4, "x1"] = "n/a"
    with pytest.raises(InvalidFeatureError, match=r"party 'host', column 'x1', row 4"):
        validate_party_tables({"guest": table(), "host": host})
    guest = table()
    guest.loc[2, "x0"] = np.nan
    with pytest.raises(InvalidFeatureError, match=r"party 'guest', column 'x0', row 2"):
        validate_party_tables({"guest": guest, "host": table()})


def test_a_coordinator_with_no_finished_round_refuses_to_save_a_model(tmp_path) -> None:
    """A model needs a committed round: the coordinator says so, as a hospital does, rather
    than failing on a checkpoint lookup."""
    from core.job_schema import HorizontalOptions
    from federation.channel import Channel
    from storage.party_store import PartyStore
    from tasks.horizontal_coordinator import Coordinator, coordinator_model
    from tasks.secure_sum import COORDINATOR, RoundStateError

    endpoint = Channel(tmp_path, "horizontal-lr-empty").endpoint(COORDINATOR)
    store = PartyStore(tmp_path / "coordinator.duckdb")
    side = Coordinator(endpoint, store, ("a", "b"), 2, HorizontalOptions())
    with pytest.raises(RoundStateError, match="horizontal-lr-empty stopped before any round"):
        coordinator_model.fn(side)
