"""Nothing secret outlives its job: after a job ends, no file under the party's folder (its
DuckDB files after a CHECKPOINT, the messages, Prefect's database and result storage) holds a
job secret's bytes in any encoding, while the secrets survive an interrupted run until then.

One-process flows and the parties' own tasks, on small tables and small keys (the key size
does not change where the bytes go).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import found_in
from prefect.logging import disable_run_logger

from core.psi import PsiError
from federation.channel import Channel
from flows.vertical_lr import FAULT_VARIABLE, InjectedFaultError, vertical_lr
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.secrets import (
    JobKeyPair,
    JobSecrets,
    SealedArtifacts,
    SecretFileError,
    SecretGoneError,
)
from tasks import psi as psi_steps
from tasks import psi_count as psi_count_steps
from tasks import secure_sum
from tasks import walr as walr_steps

pytestmark = pytest.mark.usefixtures("prefect_server")
ROWS = 140
KEY_BITS = 512  # tests only


def encodings(value: int | bytes) -> dict[str, bytes]:
    """A secret as a file could hold it: big- and little-endian bytes, hex, decimal."""
    if isinstance(value, bytes):
        number, raw = int.from_bytes(value, "little"), value
    else:
        number, raw = value, value.to_bytes((value.bit_length() + 7) // 8, "big")
    return {
        "big-endian": raw,
        "little-endian": raw[::-1],
        "hex": raw.hex().encode(),
        "HEX": raw.hex().upper().encode(),
        "reversed hex": raw[::-1].hex().encode(),
        "decimal": str(number).encode(),
    }


def leaks(folders: list[Path], secrets: dict[str, int | bytes]) -> list[str]:
    """Each (secret, encoding, file) found under ``folders``; DuckDB databases are
    checkpointed first, so what the write-ahead log held is in the file's pages."""
    found = []
    for folder in folders:
        for database in folder.rglob("*.duckdb"):
            with PartyStore(database).connect() as con:
                con.execute("CHECKPOINT")
        for file in (f for f in folder.rglob("*") if f.is_file()):
            data = file.read_bytes()
            for name, value in secrets.items():
                found += [
                    f"{name} {how} in {file}" for how, b in encodings(value).items() if b in data
                ]
    return found


def prefect_storage() -> list[Path]:
    """Where this test session's Prefect keeps its database and task results."""
    from prefect.settings import (
        PREFECT_API_DATABASE_CONNECTION_URL,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    )

    url = str(PREFECT_API_DATABASE_CONNECTION_URL.value() or "")
    database = Path(url.split("///", 1)[1]).parent if "sqlite" in url and "///" in url else None
    return [p for p in (database, Path(PREFECT_RESULTS_LOCAL_STORAGE_PATH.value())) if p]


def vertical_tables(workspace: Path) -> tuple[TableRef, TableRef]:
    rng = np.random.default_rng(3)
    ids = [f"r{i}" for i in range(ROWS)]
    X = rng.normal(size=(ROWS, 4))
    y = (X @ [1.0, -1.0, 0.5, 0.5] + rng.normal(size=ROWS) > 0).astype(float)
    guest = TableRef(str(workspace / "clinic" / "clinic.duckdb"), "t", label_column="y")
    host = TableRef(str(workspace / "lab" / "lab.duckdb"), "t")
    PartyStore.of(guest).import_frame(pd.DataFrame({"id": ids, "y": y, "g0": X[:, 0]}), guest)
    frame = pd.DataFrame({"id": ids, "h0": X[:, 1], "h1": X[:, 2], "h2": X[:, 3]})
    PartyStore.of(host).import_frame(frame, host)
    return guest, host


def test_the_scan_finds_what_a_rewritten_row_leaves_in_a_duckdb_file(tmp_path: Path) -> None:
    """The control: the old ``retire_key`` rewrote the key row to ``{"n": n}``, and p stayed
    in the file's pages; the scan must find it there."""
    p = (1 << (KEY_BITS // 2 - 1)) | int.from_bytes(os.urandom(KEY_BITS // 16)) | 1
    artifacts = ArtifactStore(PartyStore(tmp_path / "old.duckdb"))
    artifacts.put("vertical/j/keypair", {"n": 15, "p": p, "q": 3}, "secret")
    artifacts.put("vertical/j/keypair", {"n": 15}, "public-key")
    assert artifacts.get("vertical/j/keypair") == {"n": 15}
    assert any(" big-endian " in leak for leak in leaks([tmp_path], {"p": p}))


def test_vertical_key_survives_an_interrupted_run_and_is_gone_after_the_job(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest, host = vertical_tables(workspace)
    arbiter = workspace / "arbiter" / "arbiter.duckdb"
    options = {
        "batch_size": ROWS,
        "holdout_fraction": 0.0,
        "epochs": 2,
        "tol": 0.0,
        "key_size": KEY_BITS,
        "workspace": str(workspace),
        "arbiter_database": str(arbiter),
        "job_id": "secrets",
    }
    # the guest fails in round 0 of 2: the key holder, which decrypts round 1 too, keeps the
    # key (it shreds it once its last decryption is done, whatever the other sides still do)
    monkeypatch.setenv(FAULT_VARIABLE, "secrets:0")
    with pytest.raises(InjectedFaultError):
        vertical_lr(guest.to_dict(), [host.to_dict()], **options)
    monkeypatch.delenv(FAULT_VARIABLE)
    sealed = SealedArtifacts(PartyStore(arbiter), "vertical/secrets")
    factors = sealed.get("vertical/secrets/factors")  # alive while the job is
    key_file = sealed.secrets.path
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert leaks([workspace], factors) == []  # sealed in the database, not in the clear

    result = vertical_lr(guest.to_dict(), [host.to_dict()], **options)  # resumes, finishes
    assert result["resumed_from"] == -1 and result["rounds_run"] == 2
    assert not key_file.exists() and sealed.get("vertical/secrets/factors") is None
    prefect = prefect_storage()
    assert any(any(folder.glob("*.db")) for folder in prefect)  # its database is scanned too
    assert leaks([workspace, *prefect], factors) == []
    for folder in prefect:  # the scan the other privacy tests use, on Prefect's files
        assert found_in(folder, {str(v) for v in factors.values()}) == set()


def test_walr_key_is_gone_after_the_release(workspace: Path) -> None:
    rng = np.random.default_rng(4)
    ids = [f"u{i}" for i in range(80)]
    labels = TableRef(str(workspace / "shop" / "shop.duckdb"), "conversions", label_column="y")
    features = TableRef(str(workspace / "pub" / "pub.duckdb"), "impressions")
    y = (rng.random(80) < 0.4).astype(float)
    PartyStore.of(labels).import_frame(pd.DataFrame({"id": ids, "y": y}), labels)
    X = pd.DataFrame(rng.normal(size=(80, 3)), columns=["a", "b", "c"])
    PartyStore.of(features).import_frame(X.assign(id=ids)[["id", "a", "b", "c"]], features)
    PrivacyLedger(PartyStore.of(labels)).set_budget("conversions", 1.0, 1e-4)
    job = walr_steps.WalrJob(
        job_id="walr-secrets", channel=Channel(workspace, "walr-secrets"), features_party="pub",
        labels_party="shop", epsilon=1.0, delta=1e-4, mode="clipped", clip_norm=3.0,
        protected_table="conversions", labels_fingerprint="l", features_fingerprint="f",
        columns=3, key_size=KEY_BITS,
    )  # fmt: skip
    with disable_run_logger():
        walr_steps.encrypt_labels.fn(job, labels)
        walr_steps.masked_sums.fn(job, features)
        factors = job.key_pair(labels).sealed.get(job.key("factors"))
        walr_steps.release_noisy_sums.fn(job, labels)
        walr_steps.send_release.fn(job, labels)
        walr_steps.train.fn(job, features, 1.0)
    assert set(factors) == {"p", "q"}
    assert not job.key_pair(labels).sealed.secrets.exists()
    assert leaks([workspace], factors) == []


def _two_sides(
    workspace: Path, job_id: str
) -> tuple[dict[str, TableRef], dict[str, psi_steps.PsiSide]]:
    """A bank and a shop, 130 and 130 ids of which 110 are shared, each a side of ``job_id``."""
    ids = [f"c{i}" for i in range(150)]
    refs = {}
    for party, rows in (("bank", ids[:130]), ("shop", ids[20:])):
        refs[party] = TableRef(str(workspace / party / f"{party}.duckdb"), "t")
        frame = pd.DataFrame({"id": rows, "v": np.arange(len(rows), dtype=float)})
        PartyStore.of(refs[party]).import_frame(frame, refs[party])
    peer = {"bank": "shop", "shop": "bank"}
    channel = Channel(workspace, job_id)
    side = {p: psi_steps.PsiSide(r, peer[p], channel.endpoint(p)) for p, r in refs.items()}
    return refs, side


def test_psi_scalars_are_gone_once_the_rows_are_aligned(workspace: Path) -> None:
    refs, side = _two_sides(workspace, "psi-secrets")
    scalars = {}
    with disable_run_logger():
        for party, ref in refs.items():
            psi_steps.blind_own_ids.fn(side[party])
            sealed = SealedArtifacts(PartyStore.of(ref), "psi/psi-secrets")
            scalars[party] = sealed.get("psi/psi-secrets/key")
        for party in refs:
            psi_steps.blind_peer_ids.fn(side[party])
        for party in refs:
            summary = psi_steps.store_aligned_rows.fn(side[party], 100)
            assert summary["size"] == 110
    assert all(len(s) == 32 for s in scalars.values())
    assert leaks([workspace], scalars) == []


def test_psi_count_scalars_are_sealed_and_gone_once_counted(workspace: Path) -> None:
    refs, side = _two_sides(workspace, "count-secrets")
    scalars, sizes = {}, {}
    with disable_run_logger():
        for party, ref in refs.items():
            sizes[party] = psi_count_steps.blind_own_ids.fn(side[party])
            sealed = SealedArtifacts(PartyStore.of(ref), "psi-count/count-secrets")
            scalars[party] = sealed.get("psi-count/count-secrets/key")
            assert sealed.secrets.exists()  # kept sealed while the job runs
        for party in refs:
            psi_count_steps.answer_peer.fn(side[party])
        for party in refs:
            assert psi_count_steps.count_shared.fn(side[party], sizes[party], 100)["size"] == 110
    assert all(len(s) == 32 for s in scalars.values())
    assert leaks([workspace], scalars) == []
    assert not any(
        JobSecrets.of(PartyStore.of(r), "psi-count/count-secrets").exists() for r in refs.values()
    )


def test_secure_aggregation_keys_and_seeds_are_gone_after_the_sum(workspace: Path) -> None:
    parties = ("a", "b", "c")
    stores = {p: PartyStore(workspace / p / f"{p}.duckdb") for p in parties}
    ctx = secure_sum.SumContext(
        protocol="test", job_id="sum-secrets", round=0, session_id="s1", parties=parties,
        threshold=2, dimension=4, workspace=str(workspace), stage_timeout=5.0,
    )  # fmt: skip
    coordinator = secure_sum.coordinator_store(str(workspace))
    vectors = {p: np.arange(4, dtype=float) * (i + 1) for i, p in enumerate(parties)}
    for p in parties:
        secure_sum.party_advertise(stores[p], ctx, p)
    secure_sum.coordinator_directory(coordinator, ctx)
    for p in parties:
        secure_sum.party_share(stores[p], ctx, p)
    secure_sum.coordinator_route(coordinator, ctx)
    held: dict[str, int | bytes] = {}
    for p in parties:
        with secure_sum.session(stores[p], ctx, p) as records:
            state = records.state("share")
        held[f"{p} self-mask seed"] = state["self_mask_seed"]
        held[f"{p} mask key"] = state["mask_private_key"]
        held[f"{p} encryption key"] = state["encryption_private_key"]
        secure_sum.party_mask(stores[p], ctx, p, vectors[p])
    secure_sum.coordinator_collect(coordinator, ctx)
    for p in parties:
        secure_sum.party_reveal(stores[p], ctx, p)
    total, senders = secure_sum.coordinator_reconstruct(coordinator, ctx)
    np.testing.assert_allclose(total, sum(vectors.values()), atol=1e-6)
    for p in parties:
        secure_sum.forget_session(stores[p], ctx, p)
    secure_sum.forget_session(coordinator, ctx, secure_sum.COORDINATOR)
    assert sorted(senders) == list(parties)
    assert not any(JobSecrets.of(s, "test/sum-secrets/secagg").exists() for s in stores.values())
    assert leaks([workspace], held) == []


def test_a_key_file_others_may_read_is_refused(tmp_path: Path) -> None:
    secrets = JobSecrets(tmp_path / "p.duckdb", "job")
    sealed = secrets.seal({"k": 1}, "label")
    assert secrets.open(sealed, "label") == {"k": 1}
    with pytest.raises(SecretGoneError, match="another key"):
        secrets.open(sealed, "other label")  # bound to where it is stored
    os.chmod(secrets.path, 0o644)
    with pytest.raises(SecretFileError, match="not a private file"):
        secrets.open(sealed, "label")
    assert secrets.destroy() and not secrets.path.exists()
    with pytest.raises(SecretGoneError, match="destroyed"):
        secrets.open(sealed, "label")


def test_a_job_key_pair_is_made_once_sealed_and_retired_for_good(workspace: Path) -> None:
    store = PartyStore(workspace / "lab" / "lab.duckdb")
    pair = JobKeyPair(store, "walr/kp")
    assert pair.n() is None and pair.private() is None and not pair.retired()
    n = pair.create(512, allow_insecure_key_size=True)
    assert n.bit_length() == 512 and pair.create(512, allow_insecure_key_size=True) == n
    private = pair.private()
    assert private is not None and private.p * private.q == n
    assert ArtifactStore(store).get("walr/kp/keypair") == {"n": n}  # only n in the clear
    assert leaks([workspace], {"p": private.p, "q": private.q}) == []
    pair.retire()
    pair.retire()  # again, as a re-run after a crash: a no-op
    assert pair.retired() and pair.private() is None and pair.n() == n
    pair.retire("keypair")
    assert pair.n() is None


def test_a_step_after_the_blinding_never_draws_a_scalar_of_its_own(workspace: Path) -> None:
    """Reblinding (or answering) uses the scalar the party blinded its own ids with; with none
    stored it is refused, not done with a fresh one the peer's values would not match."""
    _, side = _two_sides(workspace, "no-scalar")
    with disable_run_logger():
        psi_steps.blind_own_ids.fn(side["shop"])  # the peer's ids arrive; the bank blinded none
        with pytest.raises(PsiError, match="never blinded"):
            psi_steps.blind_peer_ids.fn(side["bank"])
        with pytest.raises(PsiError, match="never blinded"):
            psi_count_steps.answer_peer.fn(side["bank"])
