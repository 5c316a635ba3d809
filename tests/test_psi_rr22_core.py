"""The VOLE-based PSI (RR22) layer by layer: GF(2^128), the banded OKVS, the silent VOLE, and
the whole protocol against the plaintext intersection, each C kernel path against its numpy
twin."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from core import psi
from core.psi_ot import base_ot, buckets, gf128, native, okvs, rr22, vole
from core.psi_ot import protocol as kkrt_psi
from core.psi_ot.primitives import prg_array, random_key, random_permutation


@contextlib.contextmanager
def kernel_path(enabled: bool):
    """Run the body on the C kernel (skipped when not built) or on the numpy path."""
    if enabled and not native.available():
        pytest.skip("the optional C kernel core.psi_ot._band is not built here")
    previous = native.set_enabled(enabled)
    try:
        yield
    finally:
        native.set_enabled(previous)


def _digests(n: int, key: bytes | None = None) -> np.ndarray:
    out = prg_array(key or random_key(), (n, 16))
    out[:, 15] = 0
    return out


def _words(n: int, key: bytes | None = None) -> np.ndarray:
    return prg_array(key or random_key(), (n, 16)).view("<u8").reshape(-1, 2)


# ---- GF(2^128) ------------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False], ids=["kernel", "numpy"])
def test_field_products_match_the_schoolbook_product(enabled: bool) -> None:
    delta, values = random_key(), _words(50)
    with kernel_path(enabled):
        got = gf128.mul_const(delta, values)
    for row, value in zip(got, values, strict=True):
        expected = gf128.mul_int(gf128.to_int(delta), int(value[0]) | int(value[1]) << 64)
        assert int(row[0]) | int(row[1]) << 64 == expected
    x = gf128.mul_x(values)
    assert (x == gf128.mul_const(gf128.from_int(2), values)).all()
    # (x^127) * x = x^128 = x^7 + x^2 + x + 1
    assert gf128.mul_int(1 << 127, 2) == 0x87


def test_packing_bits_gives_a_field_correlation() -> None:
    delta, q = random_key(), _words(3 * 128).reshape(3, 128, 2)
    bits = prg_array(random_key(), (3, 128)) & 1
    delta_words = gf128.to_words(np.frombuffer(delta, np.uint8))
    t = q ^ bits[..., None].astype(np.uint64) * delta_words  # t_k = q_k + r_k Delta
    beta = np.packbits(bits, axis=1, bitorder="little").view("<u8")
    assert (gf128.pack_bits(t) == gf128.pack_bits(q) ^ gf128.mul_const(delta, beta)).all()


# ---- the banded OKVS -----------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False], ids=["kernel", "numpy"])
def test_okvs_decodes_every_encoded_key(enabled: bool) -> None:
    key, digests = random_key(), _digests(3000)
    m = okvs.columns(len(digests))
    starts, band = okvs.bands(key, digests, m)
    values, filler = okvs.item_hash(key, digests), _words(m)
    with kernel_path(enabled):
        table = okvs.encode(starts, band, values, filler)
        assert table.shape == (m, 2)
        assert (okvs.decode(table, starts, band) == values).all()


def test_okvs_kernel_and_numpy_paths_give_the_same_table() -> None:
    key, digests = random_key(), _digests(2000)
    m = okvs.columns(len(digests))
    starts, band = okvs.bands(key, digests, m)
    values, filler = _words(len(digests)), _words(m)
    with kernel_path(True):
        fast = okvs.encode(starts, band, values, filler)
        fast_out = okvs.decode(fast, starts, band)
    with kernel_path(False):
        slow = okvs.encode(starts, band, values, filler)
        slow_out = okvs.decode(slow, starts, band)
    assert (fast == slow).all() and (fast_out == slow_out).all() and (fast_out == values).all()


def test_okvs_decodes_other_keys_to_uniform_looking_values() -> None:
    key, digests = random_key(), _digests(4000)
    m = okvs.columns(2000)
    starts, band = okvs.bands(key, digests, m)
    values = okvs.item_hash(key, digests[:2000])
    table = okvs.encode(starts[:2000], band[:2000], values, _words(m))
    other = okvs.decode(table, starts[2000:], band[2000:])
    bits = np.unpackbits(other.view(np.uint8), axis=1)
    assert len(np.unique(other, axis=0)) == 2000
    assert 0.45 < bits.mean() < 0.55
    assert (np.abs(bits.mean(axis=0) - 0.5) < 0.06).all()  # every bit position balanced
    assert not (other == okvs.item_hash(key, digests[2000:])).all(axis=1).any()


def test_okvs_edge_cases() -> None:
    key = random_key()
    empty = np.zeros((0, 16), np.uint8)
    m = okvs.columns(0)
    starts, band = okvs.bands(key, empty, m)
    filler = _words(m)
    assert (okvs.encode(starts, band, np.zeros((0, 2), np.uint64), filler) == filler).all()
    twice = np.repeat(_digests(1), 2, axis=0)  # one key, two different values: no solution
    starts, band = okvs.bands(key, twice, okvs.columns(2))
    for enabled in (True, False):
        if enabled and not native.available():
            continue
        with kernel_path(enabled), pytest.raises(okvs.OkvsError):
            okvs.encode(starts, band, _words(2), _words(okvs.columns(2)))


# ---- silent VOLE ----------------------------------------------------------------------------


def _base_ots(receiver_key: bytes, delta: bytes):
    """The VOLE receiver's seed pairs and the sender's chosen seeds (choices: Delta's bits)."""
    setup = base_ot.sender_setup(receiver_key, 1)
    chosen = base_ot.receiver_choose(setup.message(), vole.delta_bits(delta), random_key(), 2)
    return base_ot.sender_keys(setup, chosen.message, vole.WIDTH), chosen.keys


def _run_vole(m: int, stream: int = 7):
    receiver_key, delta = random_key(), random_key()
    pairs, chosen = _base_ots(receiver_key, delta)
    s, code_key = vole.shape(m), random_key()
    u, cots = vole.receiver_extend(random_key(), pairs, s, stream)
    q = vole.sender_extend(chosen, delta, u, s, stream)
    sent = vole.sender_vole(random_key(), delta, q, s, code_key, stream)
    a, c = vole.receiver_vole(
        cots, sent.message["levels"], sent.message["gamma"], s, code_key, stream
    )
    wire = u.nbytes + len(code_key) + sum(v.nbytes for v in sent.message.values())
    return delta, a, sent.b, c, wire, s


@pytest.mark.parametrize("enabled", [True, False], ids=["kernel", "numpy"])
def test_vole_correlation_holds_at_every_position(enabled: bool) -> None:
    with kernel_path(enabled):
        delta, a, b, c, wire, s = _run_vole(5000)
    assert a.shape == b.shape == c.shape == (5000, 2)
    assert (c == b ^ gf128.mul_const(delta, a)).all()
    assert len(np.unique(a, axis=0)) == 5000  # A looks uniform: no repeats, balanced bits
    assert 0.47 < np.unpackbits(a.view(np.uint8)).mean() < 0.53
    assert wire == vole.message_bytes(s)


def test_code_kernel_and_numpy_paths_give_the_same_outputs() -> None:
    code_key, values = random_key(), _words(3000)
    with kernel_path(True):
        fast = vole.compress(code_key, values, 1000)
    with kernel_path(False):
        slow = vole.compress(code_key, values, 1000)
    assert (fast == slow).all()


def test_vole_communication_is_sublinear() -> None:
    per_position = [vole.message_bytes(vole.shape(1 << k)) / (1 << k) for k in (14, 17, 20)]
    assert per_position[0] > 4 * per_position[1] > 16 * per_position[2]
    assert vole.message_bytes(vole.shape(1 << 20)) < 1.2 * vole.message_bytes(vole.shape(1 << 17))
    assert vole.message_bytes(vole.shape(1 << 17)) * 8 / (1 << 17) < 40  # bits per position


# ---- the whole PSI ---------------------------------------------------------------------------


def _wire_bytes(message: object) -> int:
    """Payload bytes of one message: its arrays and byte strings (the codec's framing aside)."""
    if isinstance(message, dict):
        return sum(_wire_bytes(value) for value in message.values())
    if isinstance(message, np.ndarray):
        return message.nbytes
    if isinstance(message, bytes):
        return len(message)
    return 8  # a size or flag


def run_rr22(a: list[object], b: list[object], bucket_ids: int = buckets.BUCKET_IDS):
    """Both sides in memory, bucket by bucket: (a's rows, b's rows, bytes sent). The smaller
    set is the receiver; rows come in (bucket, position) order on both sides."""
    keys = {"a": random_key(), "b": random_key()}
    digests = {"a": kkrt_psi.item_digests(a, "a"), "b": kkrt_psi.item_digests(b, "b")}
    sizes = {p: kkrt_psi.size_message(len(x), bucket_ids) for p, x in (("a", a), ("b", b))}
    plans = {
        "a": kkrt_psi.plan("a", "b", len(a), bucket_ids, sizes["b"]),
        "b": kkrt_psi.plan("b", "a", len(b), bucket_ids, sizes["a"]),
    }
    r, s = ("a", "b") if plans["a"].receiver else ("b", "a")
    hello = rr22.hello(keys[r])
    reply = rr22.reply(keys[s], hello, r)
    sent = [sizes["a"], sizes["b"], hello, reply]
    count = plans[r].buckets
    where = {p: buckets.bucket_of(digests[p], count) for p in (r, s)}
    rows = {r: [], s: []}
    for k in range(count):
        theirs = np.flatnonzero(where[s] == k)
        if plans[r].matrix_round(k) == k:
            mine = np.arange(len(digests[r]))
            mine = mine if plans[r].one_table else np.flatnonzero(where[r] == k)
            extend, kept = rr22.extend(keys[r], reply, plans[r], k, s)
            made = rr22.sender_vole(keys[s], hello, extend, plans[s], k, r)
            table, state = rr22.encode(
                keys[r], digests[r][mine], kept, made.message, plans[r], k, s
            )
            sent += [extend, made.message, table]
        values = rr22.values(keys[s], digests[s][theirs], made.b, table, plans[s], k, r)
        found = rr22.match(state, values, s)
        answer = rr22.matched_message(found.positions, plans[r].peer_padded)
        positions, at = rr22.sender_rows(keys[s], len(theirs), plans[s], k, answer, r)
        assert (positions == found.positions).all()
        rows[r].append(mine[found.result.rows])
        rows[s].append(theirs[at])
        sent += [values, answer]
    done = {p: np.concatenate(rows[p]) if rows[p] else np.zeros(0, np.int64) for p in rows}
    return done["a"], done["b"], sum(_wire_bytes(m) for m in sent)


def _check(a: list[object], b: list[object], **kwargs: int) -> int:
    rows_a, rows_b, wire = run_rr22(a, b, **kwargs)
    shared = set(a) & set(b)
    assert len(rows_a) == len(rows_b) == len(shared)
    assert [a[i] for i in rows_a] == [b[j] for j in rows_b]  # the same order on both sides
    assert {a[i] for i in rows_a} == shared
    return wire


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (list(range(300)), list(range(150, 700))),  # overlap, R the smaller set
        (list(range(50)), list(range(50))),  # equal sets
        (list(range(40)), list(range(100, 180))),  # disjoint
        ([], list(range(20))),  # one side empty
        ([], []),
        ([f"id-{i}" for i in range(0, 900, 3)], [f"id-{i}" for i in range(0, 900, 2)]),
    ],
    ids=["overlap", "equal", "disjoint", "empty", "both-empty", "strings"],
)
def test_rr22_intersection_equals_the_plaintext_intersection(a, b) -> None:
    _check(a, b)


def test_rr22_runs_bucket_by_bucket_and_with_one_table() -> None:
    _check(list(range(2000)), list(range(1000, 3500)), bucket_ids=400)  # several buckets
    _check(list(range(300)), list(range(100, 3000)), bucket_ids=400)  # R's set: one table


def test_rr22_sends_at_most_300_bits_per_element() -> None:
    n = 1 << 16
    a = list(range(n))
    b = list(range(n // 2, n + n // 2))
    wire = _check(a, b)
    bits = 8 * wire / n
    assert bits <= 300, bits


def test_rr22_on_the_numpy_path_equals_the_plaintext_intersection() -> None:
    with kernel_path(False):
        _check(list(range(700)), list(range(350, 1500)), bucket_ids=600)


def _one_bucket(a: list[object], b: list[object]):
    """Both sides of a one-bucket job up to S's values: (keys, digests, plans, messages)."""
    keys = {"r": random_key(), "s": random_key()}
    digests = {"r": kkrt_psi.item_digests(a, "r"), "s": kkrt_psi.item_digests(b, "s")}
    plans = {
        "r": kkrt_psi.plan("r", "s", len(a), 1 << 17, kkrt_psi.size_message(len(b), 1 << 17)),
        "s": kkrt_psi.plan("s", "r", len(b), 1 << 17, kkrt_psi.size_message(len(a), 1 << 17)),
    }
    hello = rr22.hello(keys["r"])
    reply = rr22.reply(keys["s"], hello, "r")
    extend, kept = rr22.extend(keys["r"], reply, plans["r"], 0, "s")
    made = rr22.sender_vole(keys["s"], hello, extend, plans["s"], 0, "r")
    table, state = rr22.encode(keys["r"], digests["r"], kept, made.message, plans["r"], 0, "s")
    values = rr22.values(keys["s"], digests["s"], made.b, table, plans["s"], 0, "r")
    messages = {"extend": extend, "vole": made.message, "okvs": table, "values": values}
    return keys, digests, plans, state, made, messages


def test_malformed_or_forged_messages_are_refused_naming_the_peer() -> None:
    keys, digests, plans, state, made, sent = _one_bucket(list(range(60)), list(range(30, 100)))
    short = {"u": sent["extend"]["u"][:, :-1], "code_key": sent["extend"]["code_key"]}
    with pytest.raises(psi.PsiError, match=r"extend message from r .* u must be uint8"):
        rr22.sender_vole(keys["s"], rr22.hello(keys["r"]), short, plans["s"], 0, "r")
    cut = {"okvs_key": sent["okvs"]["okvs_key"], "table": sent["okvs"]["table"][:-1]}
    with pytest.raises(psi.PsiError, match="okvs message from r is malformed or truncated"):
        rr22.values(keys["s"], digests["s"], made.b, cut, plans["s"], 0, "r")
    repeated = sent["values"]["values"].copy()
    repeated[5] = repeated[9]
    with pytest.raises(psi.PsiError, match="values message from s repeats a value"):
        rr22.match(state, {"values": repeated}, "s")
    found = rr22.match(state, sent["values"], "s")
    assert found.result.size == 30
    bitmap = rr22.matched_message(found.positions, plans["r"].peer_padded)["matched"]
    positions, rows = rr22.sender_rows(keys["s"], 70, plans["s"], 0, {"matched": bitmap}, "r")
    assert (positions == found.positions).all() and sorted(rows) == list(range(30))
    padding = bitmap.copy()
    padding[-1] |= 0x80  # 70 positions: the last byte's top bit lies past them
    with pytest.raises(psi.PsiError, match="marks padding bits"):
        rr22.sender_rows(keys["s"], 70, plans["s"], 0, {"matched": padding}, "r")
    order = random_permutation(keys["s"], 70, rr22._stream(rr22._PERMUTATION, 0))
    last = np.zeros(70, dtype=np.uint8)
    last[int(np.flatnonzero(order == 69)[0])] = 1  # the position of S's row 69
    dummy = {"matched": np.packbits(last, bitorder="little")}
    with pytest.raises(psi.PsiError, match="names a dummy"):  # were row 69 a padding dummy
        rr22.sender_rows(keys["s"], 69, plans["s"], 0, dummy, "r")
