"""shmloader/protocol.py: every message survives the wire as its own type, a malformed one is a
clear SlotProtocolError (its fds closed), and a worker of another protocol version refuses to
start, naming both versions."""

from __future__ import annotations

import array
import os
import pickle
import socket

import pytest

from shmloader import SlotProtocolError, protocol
from shmloader.channel import _FRAME, Channel

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_leaks")]

EXAMPLES = [
    protocol.Hello(protocol.PROTOCOL_VERSION, 4096),
    protocol.Task(0, 3, [4, 5, 6]),
    protocol.Task(1, 0, None),
    protocol.Grant(2, 7, 1 << 20, 1 << 20),
    protocol.Forget(2, 6),
    protocol.Resume(3),
    protocol.Stop(),
    protocol.Ready(0, 3, 2, 7, 1 << 20, 4096),
    protocol.Failed(0, 3, "fetching samples", ("KeyError", "3", "tb")),
    protocol.End(0, 9),
    protocol.State(0, 3, {"fetcher": 1}),
    protocol.Resumed(3),
    protocol.Fatal("running worker_init_fn", ("ValueError", "x", "tb")),
    protocol.Rewind(-2, 3),
    protocol.Learn(0, 0, 128, 17),
    protocol.Schema(0, 0, b"schema"),
    protocol.Rows(0, 3, 2, 1, 1 << 20, 128, 32, [4, 5, 6]),
    protocol.RowsDone(0, 3, 16, 16 * 1200000),
    protocol.Kept(2, 5, 4096, b"\x00\x01" * 8),
    protocol.NoRoom(3, 0, 20 << 20, 5 << 20),
]


def test_every_message_kind_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(protocol.MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_cross_the_channel_as_their_own_type(message):
    channel, peer = Channel.pair()
    sender = Channel(peer)
    try:
        sender.send(message)
        got, fds = channel.recv()
        assert type(got) is type(message) and got == message and fds == []
    finally:
        sender.close()
        channel.close()


def test_wire_form_is_a_bare_tuple_with_a_tag():
    wire = protocol.encode(protocol.Task(0, 1, [2]))
    assert type(wire) is tuple and wire[1:] == (0, 1, [2])
    assert protocol.decode(wire) == protocol.Task(0, 1, [2])


@pytest.mark.parametrize("wire", [(99, 1), (), ("task", 0, 0, [1]), (protocol.MESSAGES.index(protocol.Task), 0)])
def test_malformed_messages_are_protocol_errors_and_close_their_fds(wire):
    channel, peer = Channel.pair()
    r, w = os.pipe()
    try:
        before = len(os.listdir("/proc/self/fd"))
        payload = pickle.dumps(wire)
        frame = _FRAME.pack(len(payload), 1)
        peer.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
        peer.sendall(payload)
        with pytest.raises(SlotProtocolError, match="malformed control message"):
            channel.recv()
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        for fd in (r, w):
            os.close(fd)
        peer.close()
        channel.close()


def test_a_worker_of_another_version_refuses_naming_both():
    with pytest.raises(SlotProtocolError) as info:
        protocol.check_version(protocol.Hello(protocol.PROTOCOL_VERSION + 1, 4096), worker_id=3)
    text = str(info.value)
    assert f"protocol {protocol.PROTOCOL_VERSION}" in text and str(protocol.PROTOCOL_VERSION + 1) in text
    assert "worker 3" in text
    with pytest.raises(SlotProtocolError, match="expected Hello"):
        protocol.check_version(protocol.Task(0, 0, None), worker_id=0)
    protocol.check_version(protocol.Hello(protocol.PROTOCOL_VERSION, 4096), worker_id=0)


def test_a_worker_started_with_another_version_fails_at_start_up(monkeypatch):
    """End to end: a worker told another protocol version than its own refuses at start-up, and
    the loader's error names both versions (not a bare 'worker exited')."""
    import shmloader.pool as pool_module
    from shmloader import ShmDataLoader

    other = protocol.PROTOCOL_VERSION - 1
    monkeypatch.setattr(pool_module, "hello", lambda size: protocol.Hello(other, size))
    loader = ShmDataLoader(list(range(8)), batch_size=2, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(SlotProtocolError) as info:
        next(iter(loader))
    text = str(info.value)
    assert f"protocol {protocol.PROTOCOL_VERSION}" in text and f"main process {other}" in text, text
