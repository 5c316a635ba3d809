"""A vertical round's independent messages are fetched side by side, not one after another."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from test_security_keyholder import _vertical

from federation.channel import Channel, FileTransport, MessageKey, MessageTimeoutError
from tasks import vertical_lr as vlr


class SideBySide(FileTransport):
    """A peer-to-peer transport (as over the network: a party's own fetches) that answers a
    fetch only once ``expected`` different messages have been asked for: a party that waits
    for one message before asking for the next times out."""

    def __init__(self, root: Path, party: str, expected: int) -> None:
        super().__init__(root)
        self.party, self.expected = party, expected
        self.asked: set[tuple[str, str]] = set()
        self.all_asked = threading.Condition()

    def get(self, key: MessageKey, timeout: float) -> bytes:
        with self.all_asked:
            self.asked.add((key.sender, key.kind))
            self.all_asked.notify_all()
            if not self.all_asked.wait_for(lambda: len(self.asked) >= self.expected, 3.0):
                raise MessageTimeoutError(f"{key.describe()} asked alone: {sorted(self.asked)}")
        return super().get(key, timeout)


def _as(job: vlr.VerticalJob, party: str, expected: int) -> vlr.VerticalJob:
    transport = SideBySide(job.channel.transport.store().root, party, expected)
    return replace(job, channel=Channel("", job.job_id, transport, timeout=10.0))


def test_the_key_holder_asks_for_the_loss_and_every_gradient_at_once(workspace: Path) -> None:
    job, _, host_ref = _vertical(workspace)
    vlr.host_gradient.fn(job, host_ref, 0)
    arbiter = _as(job, "arbiter", expected=3)  # the guest's loss and gradient, the host's
    loss = vlr.key_holder_decrypt.fn(arbiter, 0)
    assert arbiter.channel.transport.asked == {
        ("guest", "loss_train"), ("guest", "masked_gradient"), ("mallory", "masked_gradient"),
    }  # fmt: skip
    assert loss > 0  # the round's Taylor loss, decrypted from what was fetched
    assert job.endpoint("mallory").receive("arbiter", "masked_gradient_plain", round=0)


def test_the_guest_asks_for_a_hosts_share_and_square_at_once(workspace: Path) -> None:
    job, guest_ref, _ = _vertical(workspace)
    sent = job.endpoint("guest").sent("mallory", "residual", round=0)
    guest = _as(job, "guest", expected=2)
    vlr.guest_residual.fn(guest, guest_ref, 0)  # the round again: the same messages stand
    asked = guest.channel.transport.asked
    assert asked == {("mallory", "share_train"), ("mallory", "square_train")}
    assert job.endpoint("guest").sent("mallory", "residual", round=0) == sent
