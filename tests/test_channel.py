"""shmloader/channel.py: fds that arrive with a message are delivered with it, or closed when the
message cannot be delivered (the peer disconnected mid-message, an unreadable payload)."""

from __future__ import annotations

import array
import os
import pickle
import socket

import pytest

from shmloader.channel import _FRAME, MAX_FDS, Channel, ChannelClosed
from shmloader.errors import SlotProtocolError
from shmloader.protocol import Grant

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_leaks")]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _send_frame_with_fds(sock: socket.socket, payload_length: int, fds: list[int]) -> None:
    frame = _FRAME.pack(payload_length, len(fds))
    sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def test_a_message_and_its_fds_arrive_together():
    channel, peer = Channel.pair()
    sender = Channel(peer)
    r, w = os.pipe()
    sender.send(Grant(1, 2, 4096, 0), (r,))
    message, fds = channel.recv()
    assert message == Grant(1, 2, 4096, 0) and type(message) is Grant and len(fds) == 1
    os.write(w, b"x")
    assert os.read(fds[0], 1) == b"x"  # the same pipe, through SCM_RIGHTS
    for fd in (r, w, *fds):
        os.close(fd)
    channel.close()
    sender.close()


def test_fds_of_a_message_cut_off_mid_payload_are_closed():
    channel, peer = Channel.pair()
    r, w = os.pipe()
    before = _open_fds()
    _send_frame_with_fds(peer, 100, [r, w])  # announces 100 payload bytes ...
    peer.sendall(b"only a few")  # ... and dies before the rest
    peer.close()
    with pytest.raises(ChannelClosed, match="mid-message"):
        channel.recv()
    assert _open_fds() == before - 1, "the two received fds must be closed (the peer's end too)"
    for fd in (r, w):
        os.close(fd)
    channel.close()


def test_fds_of_an_unreadable_payload_are_closed():
    channel, peer = Channel.pair()
    r, w = os.pipe()
    before = _open_fds()
    garbage = b"\x80\x05not a pickle"
    _send_frame_with_fds(peer, len(garbage), [r])
    peer.sendall(garbage)
    with pytest.raises(pickle.UnpicklingError):
        channel.recv()
    assert _open_fds() == before
    for fd in (r, w):
        os.close(fd)
    peer.close()
    channel.close()


def test_held_messages_go_in_one_write_in_the_order_sent():
    """Channel.hold (the pool's `coalesced`: a task and its grant): nothing reaches the peer
    until flush(), then everything does, in order; a message with fds flushes what is held
    first, so its fds stay with it."""
    channel, peer = Channel.pair()
    sender = Channel(peer)
    r, w = os.pipe()
    sender.hold()
    sender.send(Grant(1, 1, 4096, 0))
    sender.send(Grant(2, 1, 4096, 0))
    channel.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        channel.sock.recv(1, socket.MSG_PEEK)  # held: nothing sent yet
    sender.send(Grant(3, 1, 4096, 0), (r,))  # fds: what is held goes first, then this
    sender.send(Grant(4, 1, 4096, 0))
    sender.flush()
    sender.send(Grant(5, 1, 4096, 0))  # no longer held
    channel.sock.setblocking(True)
    got = [channel.recv() for _ in range(5)]
    assert [message.slot for message, _ in got] == [1, 2, 3, 4, 5]
    assert [len(fds) for _, fds in got] == [0, 0, 1, 0, 0]
    for fd in (r, w, *got[2][1]):
        os.close(fd)
    channel.close()
    sender.close()


def test_a_message_with_more_fds_than_the_channel_takes_is_refused_and_the_next_one_read():
    """The kernel cuts off fds past the receiver's room: the message is refused with a clear
    error and its fds closed, and it is read whole, so the next message is read from its start
    (a check found the main process reading a payload as a frame and waiting forever)."""
    channel, peer = Channel.pair()
    sender = Channel(peer)
    with pytest.raises(SlotProtocolError, match=f"at most {MAX_FDS}"):
        sender.send(Grant(1, 2, 4096, 0), tuple(range(MAX_FDS + 1)))
    r, w = os.pipe()
    before = _open_fds()
    payload = pickle.dumps(("a payload", 1))
    _send_frame_with_fds(peer, len(payload), [r] * (MAX_FDS + 2))
    peer.sendall(payload)
    sender.send(Grant(3, 4, 8192, 0))
    with pytest.raises(SlotProtocolError, match=f"announced {MAX_FDS + 2} fds"):
        channel.recv()
    assert _open_fds() == before
    assert channel.recv() == (Grant(3, 4, 8192, 0), [])
    for fd in (r, w):
        os.close(fd)
    channel.close()
    sender.close()
