"""KKRT16 PSI, layer by layer: the bit transpose, the base OTs, the OPRF's correlation, cuckoo
hashing, buckets, and the whole protocol against the plaintext intersection and the ECDH
protocol."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from core import psi
from core.ids import canonical_id
from core.psi_ot import base_ot, buckets, cuckoo, kkrt
from core.psi_ot import protocol as kkrt_psi
from core.psi_ot.bitmatrix import transpose
from core.psi_ot.primitives import aes_blocks, prg, random_key, row_hash
from storage import codec


def run_kkrt(
    a: list[object], b: list[object], min_rows: int = 1, bucket_ids: int = buckets.BUCKET_IDS
):
    """Both sides in memory, bucket by bucket, as the tasks run them: (a's result, b's result,
    the messages). The smaller set is the receiver."""
    keys = {"a": random_key(), "b": random_key()}
    digests = {"a": kkrt_psi.item_digests(a, "a"), "b": kkrt_psi.item_digests(b, "b")}
    sizes = {"a": kkrt_psi.size_message(len(a), bucket_ids)}
    sizes["b"] = kkrt_psi.size_message(len(b), bucket_ids)
    plans = {
        "a": kkrt_psi.plan("a", "b", len(a), bucket_ids, sizes["b"]),
        "b": kkrt_psi.plan("b", "a", len(b), bucket_ids, sizes["a"]),
    }
    r, s = ("a", "b") if plans["a"].receiver else ("b", "a")
    assert not plans[s].receiver and plans[r].buckets == plans[s].buckets
    hello = kkrt_psi.hello(keys[r])
    reply = kkrt_psi.reply(keys[s], hello, r)
    messages = {"size": sizes, "hello": hello, "reply": reply, "matrix": [], "values": []}
    count = plans[r].buckets
    where = {p: buckets.bucket_of(digests[p], count) for p in (r, s)}
    found = []
    for k in range(count):
        theirs = np.flatnonzero(where[s] == k)
        if plans[r].matrix_round(k) == k:  # with one table, bucket 0's holds R's whole set
            mine = np.arange(len(a if r == "a" else b))
            mine = mine if plans[r].one_table else np.flatnonzero(where[r] == k)
            matrix, state = kkrt_psi.matrix(keys[r], digests[r][mine], reply, plans[r], k, s)
            messages["matrix"].append(matrix)
        values = kkrt_psi.values(keys[s], digests[s][theirs], hello, matrix, plans[s], k, r)
        match = kkrt_psi.match(state, values, s)
        found.append((mine[match.result.rows], match.positions, theirs))
        messages["values"].append(values)
    size = sum(len(rows) for rows, _, _ in found)
    messages["result"] = kkrt_psi.result_message(size, min_rows)
    assert kkrt_psi.released_size(messages["result"], r) == size
    rows_r, rows_s = [], []
    for k, (rows, positions, theirs) in enumerate(found):
        answer = kkrt_psi.positions_message(positions)
        rows_s.append(theirs[kkrt_psi.sender_rows(keys[s], len(theirs), plans[s], k, answer, r)])
        rows_r.append(rows)
    results = {
        r: psi.Intersection(np.concatenate(rows_r), plans[r].own_size, plans[r].peer_size),
        s: psi.Intersection(np.concatenate(rows_s), plans[s].own_size, plans[s].peer_size),
    }
    return results["a"], results["b"], messages


def assert_aligned(a: list[object], b: list[object], bucket_ids: int = buckets.BUCKET_IDS):
    mine, theirs, _ = run_kkrt(a, b, bucket_ids=bucket_ids)
    expected = psi.plaintext_intersection(a, b)
    left = [canonical_id(a[i]) for i in mine.rows]
    assert left == [canonical_id(b[j]) for j in theirs.rows]  # one order on both sides
    assert set(left) == expected and len(left) == len(expected)
    assert (mine.own_size, mine.peer_size, theirs.own_size) == (len(a), len(b), len(b))
    return mine, theirs


# ---- primitives: published known answers --------------------------------------------------


def test_aes_matches_fips_197_and_the_prg_is_aes_ctr() -> None:
    key = bytes(range(16))  # FIPS-197 appendix C.1
    block = np.frombuffer(bytes.fromhex("00112233445566778899aabbccddeeff"), np.uint8)
    out = aes_blocks(key, block.reshape(1, 16)).tobytes()
    assert out.hex() == "69c4e0d86a7b0430d8cdb78070b4c55a"
    # the PRG's first block is AES of the counter block 0 (stream 0), the second of block 1
    counters = np.zeros((2, 16), np.uint8)
    counters[1, 15] = 1
    assert prg(key, 32) == aes_blocks(key, counters).tobytes()
    assert prg(key, 32, stream=1) != prg(key, 32)


def test_p256_generator_and_subtraction_match_fips_186() -> None:
    g = ec.derive_private_key(1, base_ot.CURVE).public_key().public_numbers()
    assert g.x == 0x6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296
    assert g.y == 0x4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5
    five, three, two = (ec.derive_private_key(k, base_ot.CURVE).public_key() for k in (5, 3, 2))
    assert base_ot.encode(base_ot.subtract(five, three)) == base_ot.encode(two)


@pytest.mark.parametrize("shape", [(8, 1), (64, 5), (136, 64), (1024, 3)])
def test_transpose_equals_the_bitwise_reference(shape: tuple[int, int]) -> None:
    matrix = np.frombuffer(prg(random_key(), shape[0] * shape[1]), np.uint8).reshape(shape)
    bits = np.unpackbits(matrix, axis=1, bitorder="little")
    reference = np.packbits(bits.T, axis=1, bitorder="little")
    assert np.array_equal(transpose(matrix), reference)
    assert np.array_equal(transpose(transpose(matrix)), matrix)


# ---- the OT layer ----------------------------------------------------------------------------


def _base_ots(count: int = kkrt.WIDTH):
    sender_key, receiver_key = random_key(), random_key()
    secret = base_ot.sender_setup(sender_key, 1)
    bits = list(np.frombuffer(prg(receiver_key, count, 3), np.uint8) & 1)
    choice = base_ot.receiver_choose(secret.message(), bits, receiver_key, 2)
    return bits, choice, base_ot.sender_keys(secret, choice.message, count)


def test_base_ot_receiver_gets_exactly_the_chosen_seed() -> None:
    bits, choice, pairs = _base_ots(64)
    for bit, mine, pair in zip(bits, choice.keys, pairs, strict=True):
        assert mine == pair[bit] and mine != pair[1 - bit]
    assert len({k for pair in pairs for k in pair}) == 128  # all seeds distinct


def test_base_ots_draw_fresh_randomness_from_the_os() -> None:
    keys = {kkrt_psi.new_party_key() for _ in range(64)}
    assert len(keys) == 64  # 16 bytes from the OS CSPRNG each time
    one, two = (base_ot.sender_setup(random_key(), 1).message() for _ in range(2))
    assert one != two
    bits, _, _ = _base_ots()
    assert 200 < sum(int(bit) for bit in bits) < 312  # 512 balanced choice bits (5 sigma)


def test_base_ot_refuses_points_off_the_curve() -> None:
    secret = base_ot.sender_setup(random_key(), 1)
    bad = bytearray(secret.message())
    bad[5] ^= 1  # C moves off the curve
    with pytest.raises(base_ot.BaseOtError, match="not a point of P-256"):
        base_ot.receiver_choose(bytes(bad), [0], random_key(), 2)
    with pytest.raises(base_ot.BaseOtError, match="bytes, not 2 points"):
        base_ot.sender_keys(secret, bytes(65), 2)


def test_oprf_outputs_match_only_on_the_chosen_inputs() -> None:
    bits, choice, pairs = _base_ots()
    bits = np.asarray(bits, np.uint8)
    code = kkrt.code_keys(random_key())
    inputs = np.frombuffer(prg(random_key(), 16 * 300), np.uint8).reshape(300, 16).copy()
    codes = kkrt.pseudorandom_code(code, inputs)
    u, t = kkrt.receiver_matrices(pairs, codes)
    q = kkrt.sender_rows(choice.keys, bits, u, 300)
    mask = kkrt.choice_mask(bits)
    assert np.array_equal(q, t ^ (codes & mask))  # the correlation q_i = t_i ^ (C(x_i) & s)
    # another bucket: the same base OTs, a fresh stretch of G, the same correlation
    u2, t2 = kkrt.receiver_matrices(pairs, codes, stream=7)
    q2 = kkrt.sender_rows(choice.keys, bits, u2, 300, stream=7)
    assert np.array_equal(q2, t2 ^ (codes & mask))
    assert not np.array_equal(u ^ u2, np.zeros_like(u))  # no column reused across buckets
    assert (t != t2).any(axis=1).all()
    wrong = kkrt.sender_rows(choice.keys, bits, u2, 300, stream=6)  # a stream S did not use
    assert not (wrong == t2 ^ (codes & mask)).all(axis=1).any()
    mine = kkrt.receiver_outputs(t, 16)
    same = kkrt.sender_outputs(q, mask, np.arange(300), codes, 16)
    assert np.array_equal(mine, same)
    others = inputs.copy()
    others[:, 0] ^= 1
    shifted = kkrt.sender_outputs(q, mask, np.arange(300), kkrt.pseudorandom_code(code, others), 16)
    assert not (mine == shifted).all(axis=1).any()
    rolled = kkrt.sender_outputs(q, mask, np.roll(np.arange(300), 1), codes, 16)
    assert not (mine == rolled).all(axis=1).any()  # right input, wrong bin: no match


@pytest.mark.parametrize("n", [1, 3, 700, 5000])
def test_cuckoo_places_every_item_in_one_of_its_bins(n: int) -> None:
    digests = np.frombuffer(prg(random_key(), 16 * n), np.uint8).reshape(n, 16)
    bins = cuckoo.table_size(n)
    candidates = cuckoo.candidate_bins(random_key(), digests, bins)
    table, choice = cuckoo.place(candidates, bins)
    occupied = np.flatnonzero(table >= 0)
    assert sorted(table[occupied].tolist()) == list(range(n))
    assert np.array_equal(candidates[table[occupied], choice[table[occupied]]], occupied)


# ---- the protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (list(range(50)), list(range(50, 90))),  # disjoint
        ([7], [7]),  # one id each, shared
        ([7], [8, 9]),  # one id, no match
        ([f"u{i}" for i in range(300)], [f"u{i}" for i in reversed(range(300))]),  # all ids
    ],
    ids=["disjoint", "one-id", "one-id-missing", "all-ids"],
)
def test_small_cases_match_plaintext(a: list[object], b: list[object]) -> None:
    assert_aligned(a, b)


def test_empty_side_gives_an_empty_intersection() -> None:
    mine, theirs, _ = run_kkrt([], list(range(10)))
    assert mine.size == theirs.size == 0
    with pytest.raises(psi.PsiError, match="empty"):
        psi.check_release(mine, 1)


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        (list(range(0, 900)), list(range(900, 1500)), 0),  # disjoint
        ([f"p{i}" for i in range(700)], ["p5"], 1),  # one id
        ([f"p{i}" for i in range(700)], [f"p{i}" for i in reversed(range(700))], 700),  # all
        ([f"p{i}" for i in range(30)], [f"p{i}" for i in range(0, 4000, 2)], 15),  # small, large
    ],
    ids=["disjoint", "one-id", "all-ids", "small-vs-large"],
)
def test_many_buckets_match_plaintext(a: list[object], b: list[object], shared: int) -> None:
    mine, _ = assert_aligned(a, b, bucket_ids=64)
    assert mine.size == shared


def test_buckets_are_padded_so_their_sizes_tell_nothing() -> None:
    rng = np.random.default_rng(4)
    ids = [int(x) for x in rng.choice(10**12, 3000, replace=False)]
    a, b = ids[:1000], ids[500:]
    _, _, messages = run_kkrt(a, b, bucket_ids=128)
    assert len(messages["matrix"]) == 20  # the larger set (2500) over buckets of 128
    assert len({m["bins"] for m in messages["matrix"]}) == 1  # one padded size per party
    assert len({v["values"].shape for v in messages["values"]}) == 1
    padded = buckets.padded_size(1000, 20)
    assert messages["matrix"][0]["bins"] == cuckoo.table_size(padded) and padded < 1000
    counts = np.bincount(buckets.bucket_of(kkrt_psi.item_digests(a, "a"), 20), minlength=20)
    assert counts.max() <= padded and len(set(counts.tolist())) > 1  # true sizes vary


def test_a_small_set_meets_every_bucket_of_a_large_one_with_one_table() -> None:
    rng = np.random.default_rng(7)
    ids = [int(x) for x in rng.choice(10**12, 3000, replace=False)]
    small, large = ids[:60], ids[30:]
    assert_aligned(small, large, bucket_ids=256)
    _, _, messages = run_kkrt(small, large, bucket_ids=256)
    count = math.ceil(len(large) / 256)
    assert len(messages["matrix"]) == 1 and len(messages["values"]) == count == 12
    assert messages["matrix"][0]["bins"] == cuckoo.table_size(60)  # R's set, unpadded
    padded = buckets.padded_size(len(large), count)
    width = kkrt_psi.output_bytes(cuckoo.table_size(60), padded * count)  # every comparison
    assert messages["values"][0]["values"].shape == (3, padded, width)


def test_the_smaller_set_receives_and_both_must_agree_on_buckets() -> None:
    small, large = kkrt_psi.size_message(10), kkrt_psi.size_message(5_000_000)
    assert kkrt_psi.plan("zeta", "alpha", 10, buckets.BUCKET_IDS, large).receiver
    plan = kkrt_psi.plan("alpha", "zeta", 5_000_000, buckets.BUCKET_IDS, small)
    assert not plan.receiver and plan.peer_padded == 10
    assert plan.buckets == math.ceil(5_000_000 / buckets.BUCKET_IDS)
    assert kkrt_psi.plan("alpha", "zeta", 10, buckets.BUCKET_IDS, small).receiver  # tie: name
    with pytest.raises(psi.PsiError, match="size message from zeta asks for buckets of 64"):
        kkrt_psi.plan("alpha", "zeta", 10, buckets.BUCKET_IDS, kkrt_psi.size_message(10, 64))
    with pytest.raises(psi.PsiError, match="size message from zeta gives the invalid set size"):
        kkrt_psi.plan("alpha", "zeta", 10, buckets.BUCKET_IDS, {"size": -1, "bucket_ids": 1})


@pytest.mark.parametrize("seed", [0, 1])
def test_random_sets_with_known_intersections(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = rng.choice(10**12, size=4000, replace=False)
    a = [int(x) for x in rng.choice(pool, 1500, replace=False)]
    b = [int(x) for x in rng.choice(pool, 2500, replace=False)]
    assert_aligned(a, b, bucket_ids=[buckets.BUCKET_IDS, 300][seed])


def test_one_thousand_against_one_hundred_thousand() -> None:
    big = [f"customer-{i}" for i in range(100_000)]
    small = [f"customer-{i}" for i in range(0, 200_000, 200)]  # 500 shared, 500 not
    mine, _ = assert_aligned(small, big)
    assert mine.size == 500
    theirs_first, _ = assert_aligned(big, small)  # and the other way round
    assert theirs_first.size == 500


def test_every_id_type_the_loader_accepts_matches_by_the_rule() -> None:
    a = [7, "8", 9.0, "  10 ", "x-1", "007", np.int64(12), "Jos\u00e9", "\u6771\u4eac"]
    b = ["7", 8, "9", 10, "X-1", 11, "12", "Jose\u0301", "\u6771\u4eac "]
    mine, _ = assert_aligned(a, b)
    assert {canonical_id(a[i]) for i in mine.rows} == {
        b"7",
        b"8",
        b"9",
        b"10",
        b"12",
        "Jos\u00e9".encode(),
        "\u6771\u4eac".encode(),
    }


def test_both_protocols_give_the_same_intersection() -> None:
    rng = np.random.default_rng(9)
    ids = [f"id-{x}" for x in rng.choice(10**9, 1200, replace=False)]
    a, b = ids[:800], ids[400:]
    mine, theirs, _ = run_kkrt(a, b)
    key_a, key_b = psi.new_key(), psi.new_key()
    sent_a, sent_b = psi.prepare(a, key_a, 1), psi.prepare(b, key_b, 1)
    ecdh_a = psi.intersect(
        psi.reblind(sent_a.blinded, key_b, 1), sent_a.rows, psi.reblind(sent_b.blinded, key_a, 1)
    )
    assert set(mine.rows.tolist()) == set(ecdh_a.rows.tolist())
    assert [a[i] for i in mine.rows] == [b[j] for j in theirs.rows]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 2, None], "shop: id at row 3: id is null"),
        (["a", "b", "a"], "shop: id at row 3 duplicates row 1"),
        ([7, "7"], "shop: id at row 2 duplicates row 1"),
        (["x", "a", "b", "a", "x", "a"], "shop: id at row 4 duplicates row 2"),
        ([1, 2.5], "shop: id at row 2: float id 2.5 is not an integer"),
    ],
)
def test_bad_ids_are_refused_naming_the_party(ids: list[object], message: str) -> None:
    with pytest.raises(psi.PsiError, match=message):
        kkrt_psi.item_digests(ids, "shop")


def _tampered(message: dict, **changes) -> dict:
    return {**message, **changes}


def _bank_and_shop(a: list[object], b: list[object]):
    """Keys, digests, plans, hello and reply of a one-bucket run, bank receiving."""
    key_a, key_b = random_key(), random_key()
    da, db = kkrt_psi.item_digests(a, "bank"), kkrt_psi.item_digests(b, "shop")
    plan_a = kkrt_psi.plan(
        "bank", "shop", len(a), buckets.BUCKET_IDS, kkrt_psi.size_message(len(b))
    )
    plan_b = kkrt_psi.plan(
        "shop", "bank", len(b), buckets.BUCKET_IDS, kkrt_psi.size_message(len(a))
    )
    hello = kkrt_psi.hello(key_a)
    reply = kkrt_psi.reply(key_b, hello, "bank")
    return (key_a, da, plan_a), (key_b, db, plan_b), hello, reply


def test_malformed_and_truncated_messages_are_refused_naming_the_peer() -> None:
    b = list(range(100, 300))
    (key_a, da, plan_a), (key_b, db, plan_b), hello, reply = _bank_and_shop(list(range(200)), b)
    with pytest.raises(psi.PsiError, match="reply message from shop is malformed: base_ot"):
        bad = _tampered(reply, base_ot=reply["base_ot"][:-1])
        kkrt_psi.matrix(key_a, da, bad, plan_a, 0, "shop")
    matrix, state = kkrt_psi.matrix(key_a, da, reply, plan_a, 0, "shop")
    truncated = _tampered(matrix, u=matrix["u"][:, :-1])
    with pytest.raises(psi.PsiError, match="matrix message from bank is malformed or truncated"):
        kkrt_psi.values(key_b, db, hello, truncated, plan_b, 0, "bank")
    with pytest.raises(psi.PsiError, match="has 7 bins"):
        kkrt_psi.values(key_b, db, hello, _tampered(matrix, bins=7), plan_b, 0, "bank")
    values = kkrt_psi.values(key_b, db, hello, matrix, plan_b, 0, "bank")
    short = _tampered(values, values=values["values"][:, :-1])
    with pytest.raises(psi.PsiError, match="values message from shop is malformed or truncated"):
        kkrt_psi.match(state, short, "shop")
    repeated = values["values"].copy()
    repeated[1, 5] = repeated[1, 9]
    with pytest.raises(psi.PsiError, match="repeats a value at position 5 of hash function 1"):
        kkrt_psi.match(state, _tampered(values, values=repeated), "shop")
    found = kkrt_psi.match(state, values, "shop")
    for positions in (found.positions[::-1].copy(), found.positions + len(b)):
        with pytest.raises(psi.PsiError, match="out of range or not strictly ascending"):
            answer = kkrt_psi.positions_message(positions)
            kkrt_psi.sender_rows(key_b, len(b), plan_b, 0, answer, "bank")


def test_min_rows_withholds_the_positions() -> None:
    mine, _, _ = run_kkrt(list(range(150)), list(range(60, 400)))
    assert mine.size == 90
    message = kkrt_psi.result_message(90, 100)
    assert message == {"size": 90, "released": False}
    with pytest.raises(psi.PsiError, match="refused to release the intersection of 90 rows"):
        kkrt_psi.released_size(message, "bank")


def test_messages_carry_no_id_hash_and_sizes_only() -> None:
    a, b = [f"person-{i}" for i in range(500)], [f"person-{i}" for i in range(250, 900)]
    _, _, messages = run_kkrt(a, b, bucket_ids=256)
    parts = [messages["hello"], messages["reply"], *messages["matrix"], *messages["values"]]
    wire = b"".join(
        v.tobytes() if isinstance(v, np.ndarray) else v if isinstance(v, bytes) else b""
        for m in parts
        for v in m.values()
    )
    for own in (kkrt_psi.item_digests(a, "a"), kkrt_psi.item_digests(b, "b")):
        assert not any(row[:15].tobytes() in wire for row in own[:50])
    assert not any(x.encode() in wire for x in a[:50])
    assert [m["size"] for m in messages["size"].values()] == [500, 650]


def test_a_retried_step_resends_the_same_bytes() -> None:
    a, b = [f"r{i}" for i in range(400)], [f"r{i}" for i in range(200, 700)]
    (key_a, da, plan_a), (key_b, db, plan_b), hello, reply = _bank_and_shop(a, b)
    assert codec.dumps(hello) == codec.dumps(kkrt_psi.hello(key_a))
    assert codec.dumps(reply) == codec.dumps(kkrt_psi.reply(key_b, hello, "bank"))
    matrix, _ = kkrt_psi.matrix(key_a, da, reply, plan_a, 0, "shop")
    again = kkrt_psi.matrix(key_a, da, reply, plan_a, 0, "shop")[0]
    assert codec.dumps(matrix) == codec.dumps(again)
    values = kkrt_psi.values(key_b, db, hello, matrix, plan_b, 0, "bank")
    again = kkrt_psi.values(key_b, db, hello, matrix, plan_b, 0, "bank")
    assert codec.dumps(values) == codec.dumps(again)
    other = kkrt_psi.values(random_key(), db, hello, matrix, plan_b, 0, "bank")  # another key
    assert codec.dumps(values) != codec.dumps(other)


def test_cuckoo_reports_items_that_cannot_fit() -> None:
    candidates = np.array([[0, 1, 2]] * 4, dtype=np.int64)  # four items, three bins
    with pytest.raises(cuckoo.CuckooError, match="1 of 4 items found no bin"):
        cuckoo.place(candidates, 3)


def test_row_hash_is_blake2b_of_each_row() -> None:
    abc = np.frombuffer(b"abc", np.uint8).reshape(1, 3)
    assert row_hash(abc, 64, b"").tobytes().hex() == (  # RFC 7693, appendix A
        "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1"
        "7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923"
    )
    rows = np.frombuffer(prg(random_key(), 64 * 300), np.uint8).reshape(300, 64)
    expected = [hashlib.blake2b(r.tobytes(), digest_size=11, person=b"p").digest() for r in rows]
    assert [h.tobytes() for h in row_hash(rows, 11, b"p", workers=1)] == expected
    assert np.array_equal(row_hash(rows, 11, b"p", workers=1), row_hash(rows, 11, b"p"))
