"""Distributed differential privacy in horizontal LR's rounds (Kairouz, Liu and Steinke 2021):
the noise each sum carries, with dropouts and colluders; the ring never wraps; the budget is
charged once, before any noisy sum leaves a hospital; without DP nothing changes."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core import horizontal_lr as hlr
from core.dp import distributed as dd
from core.dp.accounting import pld_epsilon
from core.dp.discrete_privacy import zcdp_delta
from core.secagg import multiround as mr
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, decode
from core.secagg.simulation import run_round, start_job
from core.secagg.weighted import unpack_weighted
from tasks.horizontal_lr import RoundCall, dp_terms

SCALE = DEFAULT_SCALE_BITS
DIMENSION = 8  # a hospital's vector for 5 features: [gradient (5 + intercept), loss, rows]


def _noise(epsilon: float = 1.0, rounds: int = 10, threshold: int = 2, colluding: int = 0,
           dimension: int = DIMENSION, clip: float = 1.0) -> dd.DistributedGaussian:  # fmt: skip
    sensitivity = dd.grid_sensitivity(hlr.dp_sensitivity(clip), SCALE, dimension)
    honest = dd.honest_shares(threshold, colluding)
    return dd.calibrate(epsilon, 1e-5, sensitivity, rounds, honest, dimension)


def _rows(seed: int, n: int = 40, d: int = DIMENSION - 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * 2.0
    return X, (rng.random(n) < 0.5).astype(float)


def test_the_calibration_meets_the_target_by_the_proven_bound_and_the_ledger_s_figure() -> None:
    noise = _noise(epsilon=1.0, rounds=20)
    assert zcdp_delta(1.0, noise.rho()) <= 1e-5 * (1 + 1e-6)  # Kairouz et al. + CKS conversion
    charged = pld_epsilon([noise.job_event()], 1e-5)
    assert 0.8 < charged <= 1.0  # the ledger's PLD figure of the same rounds: a little below
    assert charged == pytest.approx(pld_epsilon({noise.round_event(): 20}, 1e-5), abs=1e-9)
    assert noise.share_sigma == pytest.approx(noise.sigma / math.sqrt(2))


def test_the_noisy_sum_carries_the_target_variance_within_sampling_error() -> None:
    """Three hospitals' noisy ring inputs, summed in the ring and decoded: the sum's error is
    the three shares, of variance 3 sigma_share^2 (each round a fresh draw)."""
    noise, parties = _noise(rounds=5), 3
    rows = [_rows(seed) for seed in range(parties)]
    weights = np.linspace(-0.3, 0.3, DIMENSION - 2)
    exact = [hlr.clipped_contribution(weights, X, y, 1.0) for X, y in rows]
    errors = []
    for _ in range(400):
        ring = sum(hlr.noisy_ring_input(v, noise, parties, SCALE, 1.0) for v in exact)
        errors.append(decode(ring, SCALE) - sum(exact))
    errors = np.asarray(errors)
    assert np.array_equal(errors[:, -1], np.zeros(len(errors)))  # the row count stays exact
    noisy = errors[:, :-1].ravel() * 2.0**SCALE
    target = parties * noise.share_sigma**2
    assert abs(noisy.mean()) < 4 * math.sqrt(target / noisy.size)
    # the sample variance's relative standard error is sqrt(2 / n): 4 of them
    assert noisy.var() / target == pytest.approx(1.0, abs=4 * math.sqrt(2 / noisy.size))


def test_the_loss_noise_the_coordinator_allows_for_is_the_noise_the_loss_carries() -> None:
    """``dp_loss_sd`` (what the divergence check and warnings allow for) against the spread of
    the mean loss read from 400 noisy sums of three hospitals' tables."""
    noise, parties = _noise(epsilon=0.5, rounds=20), 3
    rows = [_rows(seed, n=15) for seed in range(parties)]
    weights = np.linspace(-0.3, 0.3, DIMENSION - 2)
    exact = [hlr.clipped_contribution(weights, X, y, 1.0) for X, y in rows]
    clean = hlr.round_mean(sum(exact), weights, 0.0, 1.0).mean_loss
    losses = [
        hlr.round_mean(decode(sum(hlr.noisy_ring_input(v, noise, parties, SCALE, 1.0)
                                  for v in exact), SCALE), weights, 0.0, 1.0).mean_loss
        for _ in range(400)
    ]  # fmt: skip
    sd = hlr.dp_loss_sd(noise.share_sigma, parties, 3 * 15, 1.0, SCALE)
    assert sd > 0.5  # small tables, a strict budget: noise far above the loss's own changes
    assert np.std(np.asarray(losses) - clean) / sd == pytest.approx(1.0, abs=4 / math.sqrt(800))


def test_noise_within_its_margin_is_neither_divergence_nor_a_rising_loss() -> None:
    from core.outcomes import DivergenceError, check_loss, rising

    sd = 2.0  # a loss 8 above the first is within 6 sd of two losses' difference (17)
    check_loss("horizontal_lr", "job", 3, 0.69 + 8.0, 0.69, noise_sd=sd)
    with pytest.raises(DivergenceError, match="diverged in round 3"):
        check_loss("horizontal_lr", "job", 3, 0.69 + 8.0, 0.69)  # without noise: diverged
    with pytest.raises(DivergenceError):
        check_loss("horizontal_lr", "job", 3, 0.69 + 5.0 + 17.1, 0.69, noise_sd=sd)
    noisy_climb = [0.7, 1.5, 2.4, 3.1]  # rises of about 0.8: under 2 sd of a difference (5.7)
    assert rising(noisy_climb) and not rising(noisy_climb, noise_sd=sd)
    assert rising([0.7, 7.0, 13.0, 19.0], noise_sd=sd)


@pytest.mark.parametrize(("parties", "threshold", "colluding"), [(3, 2, 0), (5, 3, 1), (10, 6, 2)])
def test_with_the_tolerated_dropouts_and_colluders_the_noise_never_falls_below_sigma(
    parties: int, threshold: int, colluding: int
) -> None:
    """Every survivor set of at least ``threshold`` senders, less any ``colluding`` of them
    (who subtract their own shares), still holds at least sigma^2 of noise."""
    noise = _noise(threshold=threshold, colluding=colluding)
    names = range(parties)
    for size in range(threshold, parties + 1):
        for senders in itertools.combinations(names, size):
            for colluders in itertools.combinations(senders, colluding):
                left = (len(senders) - len(colluders)) * noise.share_sigma**2
                assert left >= noise.sigma**2 * (1 - 1e-12)
    with pytest.raises(dd.PrivacyParameterError, match="colluding"):
        dd.honest_shares(threshold, threshold)


def test_a_dropped_hospital_s_share_leaves_the_senders_noise_in_the_unmasked_sum() -> None:
    """Through the multi-round protocol itself: with one of four dropped before masking, the
    unmasked sum is exactly the senders' clipped vectors plus their noise shares."""
    parties = ("a", "b", "c", "d")
    config = mr.new_job("dp-drop", parties, DIMENSION, min_senders=3)
    job = start_job(config)
    noise = _noise(threshold=3)
    weights = np.zeros(DIMENSION - 2)
    exact = {p: hlr.clipped_contribution(weights, *_rows(i), 1.0) for i, p in enumerate(parties)}
    ring = {p: hlr.noisy_ring_input(v, noise, 4, SCALE, 1.0) for p, v in exact.items()}
    result = run_round(job, 0, ring, silent_at_mask={"d"})
    assert result.senders == ("a", "b", "c")
    assert np.array_equal(result.ring_sum, ring["a"] + ring["b"] + ring["c"])
    error = (decode(result.ring_sum, SCALE) - sum(exact[p] for p in "abc"))[:-1] * 2.0**SCALE
    assert np.all(np.abs(error) < 10 * noise.sigma)  # three shares of sigma / sqrt(3) each


def test_no_wrap_around_at_the_largest_clipped_input_and_a_larger_one_is_refused() -> None:
    noise, parties = _noise(rounds=3), 3
    bound = noise.noise_bound()
    # the most rows whose clipped sums, at the noise bound, still fit the 64-bit ring
    most = int((2.0**63 / parties - 1 - bound) / 2.0**SCALE) - 1
    assert dd.ring_bits(most * 2.0**SCALE, noise, parties) == 64
    largest = np.full(DIMENSION, float(most))  # every coordinate at rows x max(C, 1)
    inputs = [hlr.noisy_ring_input(largest, noise, parties, SCALE, 1.0) for _ in range(parties)]
    total = sum(inputs)
    exact = parties * most * 2**SCALE
    for coordinate in range(DIMENSION):
        shares = sum(int(v.view(np.int64)[coordinate]) - most * 2**SCALE for v in inputs)
        assert int(total.view(np.int64)[coordinate]) == exact + shares  # no wrap
        assert abs(shares) < parties * bound
    with pytest.raises(dd.RingOverflowError, match="65-bit ring"):
        hlr.noisy_ring_input(largest * 2, noise, parties, SCALE, 1.0)


def test_without_dp_the_round_is_read_and_called_exactly_as_before() -> None:
    from core.job_schema import HorizontalOptions

    options = HorizontalOptions()
    assert dp_terms(options) is None
    total = np.array([3.0, -1.5, 0.25, 2.0, 10.0])
    read, before = hlr.round_mean(total, np.ones(3), 0.1), unpack_weighted(total)
    assert read.mean.tobytes() == before.mean.tobytes()  # bit for bit
    assert (read.mean_loss, read.total_weight) == (before.mean_loss, before.total_weight)
    call = RoundCall(False, ("a", "b"), 2, 60.0, (0, 0.2, 1e-3, 1e-6))
    assert "dp" not in call.to_message()  # the call's bytes are today's
    with_dp = HorizontalOptions(dp_epsilon=1.0)
    assert RoundCall.from_message({**call.to_message(), "dp": dp_terms(with_dp)}).dp == {
        "epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "colluding_parties": 0, "rounds": 20
    }  # fmt: skip


def test_what_dp_cannot_cover_is_refused_before_anything_runs() -> None:
    from core.job_schema import HorizontalOptions
    from tasks.horizontal_lr import check_dp

    check_dp(HorizontalOptions(local_epochs=2), 2, pooled_statistics=True)  # no DP: as before
    dp = HorizontalOptions(dp_epsilon=1.0)
    check_dp(dp, 2, pooled_statistics=False)
    with pytest.raises(ValueError, match="local_epochs = 0"):
        check_dp(HorizontalOptions(dp_epsilon=1.0, local_epochs=1), 2, pooled_statistics=False)
    with pytest.raises(ValueError, match="scaling to 'none'"):
        check_dp(dp, 2, pooled_statistics=True)
    with pytest.raises(dd.PrivacyParameterError, match="colluding"):
        check_dp(HorizontalOptions(dp_epsilon=1.0, colluding_parties=2), 2, False)


def test_under_dp_the_mean_is_the_clipped_gradients_plus_the_penalty() -> None:
    X, y = _rows(3, n=200)
    weights = np.linspace(-0.2, 0.2, X.shape[1] + 1)
    huge = 1e6  # no row is clipped: the mean is the plain gradient
    read = hlr.round_mean(hlr.clipped_contribution(weights, X, y, huge), weights, 0.01, huge)
    np.testing.assert_allclose(read.mean, hlr.gradient(weights, X, y, 0.01), atol=1e-12)
    assert read.mean_loss == pytest.approx(hlr.objective(weights, X, y, 0.01))
    tight = hlr.clipped_contribution(weights, X, y, 0.1)
    rows = np.hstack([X, np.ones((len(y), 1))]) * (hlr.predict_proba(weights, X) - y)[:, None]
    assert np.linalg.norm(tight[:-2]) <= 0.1 * len(y)
    assert np.linalg.norm(tight[:-2]) < np.linalg.norm(rows.sum(axis=0)) + 0.1 * len(y)


# ---------------------------------------------------------------------------------------------
# The flow: charged once before anything noisy leaves, refused over budget, resumed for free


def _ledgers(refs: list[Any]) -> dict[str, list[dict[str, Any]]]:
    from storage.ledger import PrivacyLedger
    from storage.party_store import PartyStore

    return {r.party: PrivacyLedger(PartyStore.of(r)).spends("patients") for r in refs}


@pytest.mark.usefixtures("prefect_server")
def test_a_dp_run_is_charged_once_refused_over_budget_and_resumed_without_a_second_charge(
    workspace: Path,
) -> None:
    from test_horizontal_flow import load_hospitals, run

    from core.secagg.errors import ProtocolViolationError
    from federation.workspace import channel_for
    from flows.horizontal_lr import SimulatedCrashError
    from storage.ledger import BudgetError, PrivacyLedger
    from storage.party_store import PartyStore

    refs = load_hospitals(workspace)
    options = {"rounds": 2, "learning_rate": 0.5, "l2": 1e-3, "tol": 0.0, "stage_timeout": 10,
               "dp_epsilon": 2.0, "preprocessing": {"scaling": "none"}}  # fmt: skip
    for ref in refs:  # too little for (2, 1e-5) over 2 rounds
        PrivacyLedger(PartyStore.of(ref)).set_budget("patients", 1.0, 1e-5)
    with pytest.raises((BudgetError, ProtocolViolationError), match="exceeds the budget"):
        run(refs, workspace, job_id="hlr-dp-poor", **options)
    channel = channel_for("hlr-dp-poor", str(workspace))
    assert not [r for r in channel.log() if r.base_kind == "secagg_masked"]  # nothing noisy left
    assert _ledgers(refs) == {r.party: [] for r in refs}

    for ref in refs:
        PrivacyLedger(PartyStore.of(ref)).set_budget("patients", 5.0, 1e-5)
    # every hospital answers from here on: a deadline of 30 s, not 10, so that a loaded machine
    # (a full test run shares two cores) does not drop all three at the job's keys
    options["stage_timeout"] = 30
    with pytest.raises(SimulatedCrashError):  # killed in round 1, its noisy inputs sent
        run(refs, workspace, job_id="hlr-dp", crash_after="1:mask_input", **options)
    charged = _ledgers(refs)
    assert all(len(spends) == 1 for spends in charged.values())  # both rounds, at once
    assert all(s[0]["epsilon"] == 2.0 and "vector" in s[0]["event"] for s in charged.values())
    resumed = run(refs, workspace, job_id="hlr-dp", **options)
    assert resumed["rounds_completed"] == 2 and resumed["resumed_from"] == 1
    assert _ledgers(refs) == charged  # the resumed run paid nothing again
    sds = [entry["loss_sd"] for entry in resumed["history"]]  # same senders and rows: same noise
    assert len(sds) == 2 and sds[0] > 0 and sds[0] == pytest.approx(sds[1])
    X = np.vstack([PartyStore.of(r).read_table(r).iloc[:, 2:].to_numpy(float) for r in refs])
    y = np.concatenate([PartyStore.of(r).read_table(r)["diagnosis"].to_numpy(float) for r in refs])
    exact = hlr.centralized_gd(X, y, 1e-3, 0.5, 2)
    assert np.max(np.abs(np.asarray(resumed["weights"]) - exact)) > 1e-3  # clipped and noisy
    masked = [r for r in channel_for("hlr-dp", str(workspace)).log()
              if r.base_kind == "secagg_masked"]  # fmt: skip
    assert sorted((r.round, r.sender) for r in masked) == sorted(
        (round_, r.party) for round_ in (0, 1) for r in refs
    )  # each round masked once per hospital: round 1's stored inputs were re-sent, not redrawn
