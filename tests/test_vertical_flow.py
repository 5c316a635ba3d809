"""Vertical LR: the encrypted protocol equals its plaintext twin, leaks no plaintext, resumes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import chart_images
from phe.paillier import PaillierPrivateKey, PaillierPublicKey
from prefect.artifacts import Artifact

from core.paillier import cipher, native
from core.paillier.errors import KeySizeError
from core.paillier.keys import SMALL_KEYS_VARIABLE
from core.paillier.randomness import pool_path
from core.preprocessing import PreprocessingSpec, fit_local
from core.vertical_lr.reference import train_reference
from core.vertical_lr.schedule import Schedule
from core.vertical_lr.steps import Optimizer
from federation.channel import Channel
from federation.workspace import channel_for
from flows.vertical_lr import FAULT_VARIABLE, InjectedFaultError, vertical_lr
from storage import codec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.secrets import SealedArtifacts
from tasks.reporting import short_id
from tasks.vertical_lr import (
    VerticalSetupError,
    agreed_job,
    keys_job,
    obfuscators_needed,
    prepare_key,
    prepare_pool,
)

pytestmark = pytest.mark.usefixtures("prefect_server")
DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "fate"
# batches above a host's feature count + LABEL_LEAK_MARGIN: 180 training rows, 2 batches of 90
ROWS, BATCH, EPOCHS, SEED = 200, 90, 2, 3
OPTIONS = {
    "epochs": EPOCHS,
    "batch_size": BATCH,
    "learning_rate": 0.15,
    "momentum": 0.9,
    "l2": 0.01,
    "seed": SEED,
    "key_size": 1024,
    "tol": 0.0,
}


def breast(workspace: Path, host_splits: int = 1):
    guest = pd.read_csv(DATA / "breast_hetero_guest.csv.gz").head(ROWS)
    host = pd.read_csv(DATA / "breast_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    guest_ref = TableRef(
        database=str(workspace / "guest.duckdb"),
        table="patients",
        label_column="y",
        label_domain=(0, 1),
    )
    PartyStore.of(guest_ref).import_frame(guest, guest_ref)
    host_refs, host_X = [], []
    for i, columns in enumerate(np.array_split(host.columns, host_splits)):
        ref = TableRef(database=str(workspace / f"host{i}.duckdb"), table="labs")
        PartyStore.of(ref).import_frame(host[columns].reset_index(), ref)
        host_refs.append(ref)
        host_X.append(host[columns].to_numpy())
    guest_X = guest[[c for c in guest.columns if c.startswith("x")]].to_numpy()
    return guest_ref, host_refs, guest_X, host_X, guest["y"].to_numpy()


def standardised(X: np.ndarray) -> np.ndarray:
    """What every party does to its own columns by default (the job's preprocessing)."""
    names = [f"x{j}" for j in range(X.shape[1])]
    return fit_local(X, names, PreprocessingSpec()).transform(X)


def reference(guest_X, host_X, y):
    schedule = Schedule(len(y), BATCH, SEED, 0.1)
    guest_X, host_X = standardised(guest_X), [standardised(X) for X in host_X]
    return train_reference(guest_X, host_X, y, schedule, EPOCHS, Optimizer(0.15, 0.9, 0.0, 0.01))


def assert_same_model(result, expected, guest_ref, host_refs) -> None:
    assert result["party"] == guest_ref.party  # the result is the guest's slice only
    assert result["intercept"] == pytest.approx(expected.guest_weights[0], abs=1e-12)
    got_guest = np.array(list(result["coefficients"].values()))
    np.testing.assert_allclose(got_guest, expected.guest_weights[1:], atol=1e-12)
    for ref, weights in zip(host_refs, expected.host_weights, strict=True):
        # each host's slice is in its own store, not in the guest's result
        model = ArtifactStore(PartyStore.of(ref)).get(
            f"models/vertical/{result['job_id']}/{ref.party}"
        )
        np.testing.assert_allclose(list(model["coefficients"].values()), weights, atol=1e-12)
    np.testing.assert_allclose(result["losses"], expected.losses, atol=1e-12)


def prepare_pools(workspace: Path, guest_ref: TableRef, host_refs: list[TableRef]) -> set[int]:
    """Ahead of the run: the arbiter creates the job's key, every encrypting party fills its
    own pool with what the job needs. Returns the obfuscators pooled at the first host."""
    job = keys_job(
        "pooled",
        guest_ref.party,
        tuple(h.party for h in host_refs),
        key_holder_database=str(workspace / "parties" / "arbiter.duckdb"),
        channel=Channel(workspace, "pooled"),
        key_size=1024,
    )
    prepare_key(job, 1024)
    job = agreed_job(job, ROWS, {}, BATCH, 0.1)
    for ref in (guest_ref, *host_refs):
        assert prepare_pool(job, ref, obfuscators_needed(job, ref.party, EPOCHS)) > 0
    n = (
        channel_for("pooled", str(workspace))
        .endpoint(guest_ref.party)
        .receive("arbiter", "public_key")
    )
    path = pool_path(host_refs[0].database, n, "full")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    record = (2 * int(n).bit_length() + 7) // 8
    data = path.read_bytes()[128:]
    return {int.from_bytes(data[i : i + record], "big") for i in range(0, len(data), record)}


@pytest.mark.parametrize(
    ("hosts", "arbiter", "pooled"), [(1, True, False), (2, True, True), (1, False, False)]
)
def test_encrypted_training_equals_plaintext_protocol(
    workspace: Path, hosts: int, arbiter: bool, pooled: bool
) -> None:
    guest_ref, host_refs, guest_X, host_X, y = breast(workspace, hosts)
    if pooled:
        arbiter_store = ArtifactStore(PartyStore(workspace / "parties" / "arbiter.duckdb"))
        pooled_values = prepare_pools(workspace, guest_ref, host_refs)
        keypair = arbiter_store.get("vertical/pooled/keypair")  # n; p, q are sealed apart
        sealed = SealedArtifacts(arbiter_store.store, "vertical/pooled")
        keypair.update(sealed.get("vertical/pooled/factors"))
    result = vertical_lr(
        guest_ref.to_dict(),
        [h.to_dict() for h in host_refs],
        arbiter=arbiter,
        workspace=str(workspace),
        job_id="pooled" if pooled else None,
        **OPTIONS,
    )
    assert_same_model(result, reference(guest_X, host_X, y), guest_ref, host_refs)
    if pooled:  # the first host's ciphertexts are hidden by its pool's values, each used once
        n, p, q = (int(keypair[k]) for k in "npq")
        private = PaillierPrivateKey(PaillierPublicKey(n), p, q)
        guest = channel_for("pooled", str(workspace)).endpoint(guest_ref.party)
        used = []
        for round_ in range(EPOCHS * 2):
            shares = guest.receive(host_refs[0].party, "share_train", round=round_)
            for c, m in zip(shares, cipher.decrypt(private, shares), strict=True):
                used.append(c * pow(1 + (m % n) * n, -1, n * n) % (n * n))
        assert len(set(used)) == len(used) and set(used) <= pooled_values
        for ref in (guest_ref, *host_refs):  # the job's key is retired: so are the pools
            assert not pool_path(ref.database, n, "full").exists()
    assert result["metrics"]["train_auc"] > 0.95
    scores = PartyStore.of(guest_ref).read_table(
        TableRef(guest_ref.database, result["scores_table"], id_column="id")
    )
    assert len(scores) == ROWS and scores["probability"].between(0, 1).all()
    # the job is named by its table; the job id is part of the key (a derived one shortened)
    key = f"{guest_ref.table}-vertical-{short_id(result['job_id'])}-"
    rounds = Artifact.get(f"{key}rounds")
    assert rounds is not None and rounds.type == "table"
    link = Artifact.get(f"{key}model")
    assert link is not None and "models/vertical/" in link.data  # a link to the saved model
    # the charts: every round's loss and the guest's held-out ROC, as SVG images in markdown
    charts = Artifact.get(f"{key}charts")
    assert charts is not None and charts.type == "markdown"
    loss_svg, roc_svg = chart_images(charts.data)
    # the held-out loss of each epoch's end beside the training loss, as the rounds table has it
    held_out = [r["holdout_loss"] for r in result["history"] if "holdout_loss" in r]
    assert len(held_out) == EPOCHS
    table = [r for r in json.loads(rounds.data) if r.get("held-out loss") is not None]
    assert [r["held-out loss"] for r in table] == pytest.approx(held_out)
    assert loss_svg.count("<circle") == len(result["losses"]) + EPOCHS
    assert "held-out rows" in loss_svg and 'stroke-dasharray="6 4"' in loss_svg
    assert f"ROC on 20 held-out rows, AUC {result['metrics']['holdout_auc']:.4f}" in roc_svg
    # the encrypted Taylor loss is the real Taylor loss of the weights before each round
    assert result["losses"][0] == pytest.approx(np.log(2))


@pytest.mark.skipif(len(native.supported_paths()) < 2, reason="one kernel path on this CPU")
def test_every_kernel_path_trains_the_same_model_bit_for_bit(workspace: Path) -> None:
    """Issue 39's "model unchanged": the job's Paillier work runs on this process's threads,
    so forcing a path here forces it for the whole job; every path gives the same model."""
    guest_ref, host_refs, *_ = breast(workspace)
    models = set()
    for path in native.supported_paths():
        previous = native.set_path(path)
        try:
            result = vertical_lr(
                guest_ref.to_dict(),
                [h.to_dict() for h in host_refs],
                workspace=str(workspace),
                job_id=f"path-{path}",
                **OPTIONS,
            )
        finally:
            native.set_path(previous)
        models.add(repr((result["intercept"], result["coefficients"], result["losses"])))
    assert len(models) == 1


def test_no_plaintext_residual_gradient_or_feature_crosses(workspace: Path) -> None:
    guest_ref, host_refs, *_ = breast(workspace, 2)
    result = vertical_lr(
        guest_ref.to_dict(), [h.to_dict() for h in host_refs], workspace=str(workspace), **OPTIONS
    )
    channel = channel_for(result["job_id"], str(workspace))
    # the documented plaintext exchanges: the set-up's public facts (feature counts, the id
    # order's digest, the row count and widths, the key), the key holder's decrypted batch
    # losses and stop decision to the guest, masked gradients, and scores after training
    plain_kinds = {
        "public_key", "id_order_digest", "masked_gradient_plain", "scores", "features",
        "setup", "loss_value_train", "loss_value_holdout", "stop",
    }  # fmt: skip
    seen = set()
    for record in channel.log():
        seen.add(record.kind)
        payload = codec.loads(channel.read_raw(record))
        if record.kind in plain_kinds:
            continue
        assert isinstance(payload, list), record
        # ciphertexts are integers modulo n^2: huge, never a small fixed-point value
        assert all(isinstance(c, int) and c.bit_length() > 1500 for c in payload), record
    assert {"share_train", "residual", "masked_gradient", "loss_train"} <= seen
    # masked gradients come back masked by 256-bit values: no small (true-gradient-sized) ints
    for record in channel.log():
        if record.kind == "masked_gradient_plain":
            values = codec.loads(channel.read_raw(record))
            assert min(abs(v) for v in values) > 2**120
    # scores are the documented prediction exchange: host -> guest, after training only
    assert {r.sender for r in channel.log() if r.kind == "scores"} == {h.party for h in host_refs}


def test_bad_inputs_are_refused(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guest_ref, host_refs, *_ = breast(workspace)
    hosts = [h.to_dict() for h in host_refs]
    with monkeypatch.context() as without_opt_in:  # a process that did not opt in
        without_opt_in.delenv(SMALL_KEYS_VARIABLE)
        with pytest.raises(KeySizeError, match=f"below 2048 bits.*{SMALL_KEYS_VARIABLE}=1"):
            vertical_lr(guest_ref.to_dict(), hosts, workspace=str(workspace), **OPTIONS)
    assert not (workspace / "parties" / "arbiter.duckdb").exists()  # refused before any key
    host_with_label = TableRef(database=host_refs[0].database, table="labs", label_column="x0")
    with pytest.raises(VerticalSetupError, match="only the guest may hold labels"):
        vertical_lr(
            guest_ref.to_dict(), [host_with_label.to_dict()], workspace=str(workspace), **OPTIONS
        )
    store = PartyStore.of(host_refs[0])
    shuffled = store.read_table(host_refs[0]).sample(frac=1.0, random_state=1)
    store.import_frame(shuffled, host_refs[0])
    with pytest.raises(VerticalSetupError, match="not aligned"):
        vertical_lr(guest_ref.to_dict(), hosts, workspace=str(workspace), **OPTIONS)
    frame = PartyStore.of(guest_ref).read_table(guest_ref).assign(y=1.0)
    all_ones = TableRef(database=guest_ref.database, table="ones", label_column="y")
    PartyStore.of(all_ones).import_frame(frame, all_ones)
    with pytest.raises(VerticalSetupError, match="labels must be binary"):
        vertical_lr(all_ones.to_dict(), hosts, workspace=str(workspace), **OPTIONS)


def test_a_failed_run_resumes_and_ends_with_the_same_model(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest_ref, host_refs, guest_X, host_X, y = breast(workspace)
    hosts = [h.to_dict() for h in host_refs]
    run = {"workspace": str(workspace), "job_id": "faulty", **OPTIONS}
    monkeypatch.setenv(FAULT_VARIABLE, "faulty:3")  # the tests-only fault switch
    with pytest.raises(InjectedFaultError):
        vertical_lr(guest_ref.to_dict(), hosts, **run)
    monkeypatch.delenv(FAULT_VARIABLE)
    resumed = vertical_lr(guest_ref.to_dict(), hosts, **run)
    assert resumed["resumed_from"] == 2  # rounds 0-2 finished before the fault in round 3
    total = EPOCHS * Schedule(ROWS, BATCH, SEED, 0.1).batches_per_epoch
    assert resumed["rounds_run"] == total - 3 > 0
    assert_same_model(resumed, reference(guest_X, host_X, y), guest_ref, host_refs)
