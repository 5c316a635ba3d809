"""The wire format refuses what it cannot safely read; channel names cannot collide."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from federation.channel import Channel, ChannelError, MessageTimeoutError
from storage import codec
from storage.descriptor import DescriptorError, TableRef


def test_binary_format_is_compact_for_ciphertext_vectors() -> None:
    ciphertexts = [2**4095 + i for i in range(100)]
    data = codec.dumps({"ct": ciphertexts})
    assert len(data) < 100 * 512 + 64  # raw width, no base64 or JSON overhead
    assert codec.loads(data)["ct"] == ciphertexts
    values = codec.loads(codec.dumps([-3, 0, 2**70, (1, 2)]))
    assert values == [-3, 0, 2**70, [1, 2]]
    array = codec.loads(codec.dumps(np.arange(6, dtype=np.int32).reshape(2, 3)))
    assert array.dtype == np.int32 and array.shape == (2, 3) and array.flags.writeable


def _int_header(sign: int, width: int) -> bytes:
    return codec.MAGIC + b"i" + bytes([sign, width])


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (codec.MAGIC + b"f" + struct.pack("<d", float("nan")), "non-finite"),
        (codec.MAGIC + b"f" + struct.pack("<d", float("inf")), "non-finite"),
        (codec.MAGIC + b"d\x02\x01aN\x01aT", "duplicate dict key 'a'"),
        # an integer of 4000 bytes (32000 bits) is above the 16384-bit cap
        (codec.MAGIC + b"i\x00\xa0\x1f" + b"\x01" * 4000, "exceeds 16384 bits"),
        (codec.MAGIC + b"I\x02\x00\x00", "width 0"),
        (codec.MAGIC + b"b\x0a" + b"xx", "runs past the end"),
        # header claims 10^10 float64 elements (74.5 GiB) but holds 8 bytes
        (codec.MAGIC + b"A<f8\x01\x80\xc8\xaf\xa0%" + b"\x00" * 8, "claims 10000000000 elements"),
        (codec.MAGIC + b"l\xff\xff\xff\x7f", "claims 268435455 items"),
        (codec.MAGIC + b"A|O8\x01\x01" + b"\x00" * 8, "dtype '|O8'"),
        (codec.MAGIC + b"NN", "trailing bytes"),
        (b"\x80\x04K\x01.", "bad magic"),  # a pickle is not even looked at
        (b'{"a": 1}', "bad magic"),
    ],
)
def test_codec_refuses_what_it_cannot_read(data: bytes, reason: str) -> None:
    with pytest.raises(codec.CodecError, match=reason):
        codec.loads(data)


def test_codec_limits_on_writing_and_size() -> None:
    with pytest.raises(codec.CodecError, match="non-finite"):
        codec.dumps({"w": np.array([1.0, np.nan])})
    with pytest.raises(codec.CodecError, match="bits"):
        codec.dumps(2**20000)
    small = codec.Limits(max_bytes=100)
    with pytest.raises(codec.CodecError, match="exceeds the cap of 100"):
        codec.dumps(b"x" * 200, small)
    with pytest.raises(codec.CodecError, match="exceeds the cap of 100"):
        codec.loads(codec.dumps(b"x" * 200), small)
    nested: list = []
    for _ in range(100):
        nested = [nested, 0.5]
    with pytest.raises(codec.CodecError, match="nesting"):
        codec.dumps(nested)
    # a party's own artifacts may hold NaN (e.g. an undefined metric); messages may not
    assert np.isnan(codec.loads(codec.dumps(float("nan"), codec.ARTIFACT), codec.ARTIFACT))


def test_a_malformed_message_is_refused_naming_the_key(tmp_path: Path) -> None:
    channel = Channel(tmp_path, "job-3")
    key = channel.key(0, "a", "b", "x")
    channel.transport.put(key, codec.MAGIC + b"A<f8\x01\x05" + b"\x00" * 8)
    with pytest.raises(ChannelError, match=r"refused the 'x' message from a to b in round 0"):
        channel.endpoint("b").receive("a", "x")


@pytest.mark.parametrize(
    "name", ["x__y", "y\n", "..", "a..b", ".hidden", "a/b", "x_", "_x", "", "é", "a" * 81]
)
def test_names_that_could_collide_or_escape_are_refused(tmp_path: Path, name: str) -> None:
    channel = Channel(tmp_path, "job-4")
    with pytest.raises(ValueError, match="must be 1-80"):
        channel.endpoint(name)
    with pytest.raises(ValueError, match="must be 1-80"):
        channel.endpoint("a").send("b", name, 1)
    with pytest.raises(ValueError, match="must be 1-80"):
        Channel(tmp_path, name)


def test_name_collision_attack_fails(tmp_path: Path) -> None:
    """15.8: with "__" in names, x's message to y__z and x__y's to z were one file."""
    channel = Channel(tmp_path, "job-5")
    with pytest.raises(ValueError):
        channel.endpoint("x").send("y__z", "k", 1)
    with pytest.raises(ValueError):
        channel.endpoint("x__y").send("z", "k", 1)
    channel.endpoint("x").send("y", "k", "for y")
    with pytest.raises(MessageTimeoutError, match=r"from x to z in round 0 of job job-5"):
        channel.endpoint("z").receive("x", "k")
    with pytest.raises(DescriptorError):
        TableRef(database=str(tmp_path / "p.duckdb"), table="t\n", party="p")


def test_receive_waits_for_a_late_message(tmp_path: Path) -> None:
    import threading

    channel = Channel(tmp_path, "job-6")
    later = threading.Timer(0.3, lambda: channel.endpoint("a").send("b", "late", [1, 2], round=2))
    later.start()
    assert channel.endpoint("b").receive("a", "late", round=2, timeout=10) == [1, 2]
    with pytest.raises(MessageTimeoutError, match=r"0.2 s.*'never' message from a to b in round 2"):
        channel.endpoint("b").receive("a", "never", round=2, timeout=0.2)
