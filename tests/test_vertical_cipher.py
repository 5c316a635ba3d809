"""The integer Paillier operations the vertical protocol and WALR use, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from core.paillier import cipher
from core.paillier.keys import generate_keypair


@pytest.fixture(scope="module")
def keys():
    return generate_keypair(1024, allow_insecure_key_size=True)


def exact(X: np.ndarray, d: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(X, dtype=object).T.dot(np.asarray(d, dtype=object))]


def test_operations_equal_integer_arithmetic(keys) -> None:
    public, private = keys
    rng = np.random.default_rng(4)
    d = rng.integers(-(2**40), 2**40, 50)
    X = rng.integers(-(2**20), 2**20, (50, 3))
    cts = cipher.encrypt(public, [int(v) for v in d])
    assert cipher.decrypt(private, cts) == [int(v) for v in d]
    assert cipher.decrypt(private, cipher.transpose_dot(public, X, cts)) == exact(X, d)
    weights = [int(w) for w in rng.integers(-(2**30), 2**30, 50)]
    assert cipher.decrypt(private, [cipher.weighted_sum(public, cts, weights)]) == [
        sum(w * int(v) for w, v in zip(weights, d, strict=True))
    ]
    fresh = cipher.rerandomize(public, cts, "djn")
    assert not set(fresh) & set(cts) and cipher.decrypt(private, fresh) == [int(v) for v in d]


def test_dask_cluster_gives_the_same_results(keys, monkeypatch: pytest.MonkeyPatch) -> None:
    from dask.distributed import LocalCluster

    public, private = keys
    rng = np.random.default_rng(5)
    d = rng.integers(-(2**30), 2**30, 300)
    X = rng.integers(-(2**20), 2**20, (300, 8))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as cluster:
        monkeypatch.setenv(cipher.DASK_ADDRESS_VARIABLE, cluster.scheduler_address)
        monkeypatch.setattr(cipher, "_parallel_backend", None)
        cts = cipher.encrypt(public, [int(v) for v in d])  # obfuscators computed on the cluster
        product = cipher.transpose_dot(public, X, cts)
        assert isinstance(cipher._parallel_backend, cipher.DaskBackend)
        cipher._parallel_backend.close()
    monkeypatch.setattr(cipher, "_parallel_backend", None)
    assert cipher.decrypt(private, product) == exact(X, d)
