"""Serial, process-pool and Dask execution give identical results."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from core.paillier import (
    BackendError,
    DaskBackend,
    DJNRandomizer,
    EncryptedVector,
    ObfuscatorPool,
    ProcessBackend,
    StandardRandomizer,
    encode_matrix,
    encode_values,
    generate_keypair,
    pack,
)
from core.paillier.parallel import chunk_bounds

TEST_KEY_BITS = 512
ROWS = 300


@pytest.fixture(scope="module")
def keypair():
    return generate_keypair(TEST_KEY_BITS, allow_insecure_key_size=True)


@pytest.fixture(scope="module")
def workload(keypair):
    """An encrypted vector, a feature matrix and the serial reference results."""
    public_key, _ = keypair
    rng = np.random.default_rng(secrets.randbits(32))
    values = rng.uniform(-1, 1, ROWS)
    values[:3] = [0.0, 1.0, -1.0]
    vector = EncryptedVector.encrypt(public_key, values, randomizer=DJNRandomizer(public_key))
    features = encode_matrix(rng.standard_normal((ROWS, 4)) * 5, 16)
    factors = rng.standard_normal(ROWS)
    selection = rng.integers(0, 2, (ROWS, 3)).astype(bool)
    serial = {
        "xt_dot": vector.transpose_dot(features).ciphertexts,
        "subset": vector.subset_sums(selection).ciphertexts,
        "multiply": vector.multiply(factors).ciphertexts,
        "scalar": vector.multiply(-3.5).ciphertexts,
        "packed": pack(vector, max_abs_value=1.0).ciphertexts,
    }
    return vector, features, factors, selection, serial


def run_everything(vector, features, factors, selection, backend) -> dict[str, list]:
    return {
        "xt_dot": vector.transpose_dot(features, backend=backend).ciphertexts,
        "subset": vector.subset_sums(selection, backend=backend).ciphertexts,
        "multiply": vector.multiply(factors, backend=backend).ciphertexts,
        "scalar": vector.multiply(-3.5, backend=backend).ciphertexts,
        "packed": list(pack(vector, max_abs_value=1.0, backend=backend).ciphertexts),
    }


def check_backend(keypair, workload, backend) -> None:
    public_key, private_key = keypair
    vector, features, factors, selection, serial = workload
    results = run_everything(vector, features, factors, selection, backend)
    assert {k: list(v) for k, v in results.items()} == {k: list(v) for k, v in serial.items()}
    expected_plaintexts = vector.decrypt_integers(private_key)
    assert vector.decrypt_integers(private_key, backend=backend) == expected_plaintexts

    # Encryption is randomized, so compare plaintexts and check freshness instead.
    values = np.linspace(-2, 2, 40)
    for randomizer in (StandardRandomizer(public_key), DJNRandomizer(public_key)):
        fresh = EncryptedVector.encrypt(public_key, values, randomizer=randomizer, backend=backend)
        assert len(set(fresh.ciphertexts)) == 40
        assert fresh.decrypt_integers(private_key) == encode_values(values, 32)
    pool = ObfuscatorPool(StandardRandomizer(public_key))
    pool.fill(24, backend=backend)
    assert len(set(pool.obfuscators(24))) == 24


def test_chunk_bounds_cover_the_range_exactly():
    for length in (0, 1, 7, 300):
        for parts in (1, 2, 5, 400):
            bounds = chunk_bounds(length, parts)
            covered = [i for start, stop in bounds for i in range(start, stop)]
            assert covered == list(range(length))
            assert all(stop > start for start, stop in bounds)


def test_process_pool_matches_serial(keypair, workload):
    with ProcessBackend(2) as backend:
        check_backend(keypair, workload, backend)


def test_dask_cluster_matches_serial(keypair, workload):
    distributed = pytest.importorskip("dask.distributed")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        DaskBackend(cluster.scheduler_address, allow_private_key=True) as backend,
    ):
        assert backend.parallelism == 2
        check_backend(keypair, workload, backend)
        with (
            DaskBackend(cluster.scheduler_address) as guarded,
            pytest.raises(BackendError, match="private-key"),
        ):
            workload[0].decrypt(keypair[1], backend=guarded)
