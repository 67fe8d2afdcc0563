"""The control channel between the main process and one worker: small framed messages, plus fds.

Only a few integers per batch cross it (NOTE [ Slot lifecycle ] in ring.py): the batch bytes
never do.  Each message (protocol.py) is a 5-byte frame header (payload length, fd count) followed
by its pickled wire tuple; a message that carries fds (a slot segment) sends them as SCM_RIGHTS ancillary data with
its frame header.  One stream socket per worker keeps the order of messages and fds together.
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import struct
from typing import Any

from .errors import SlotProtocolError
from .ownership import no_fork_meanwhile, register_parent_only
from .protocol import decode, encode

_FRAME = struct.Struct("<IB")
# The most fds one message carries: a slot's segment and the storages of a batch's views
# (shared_views.MAX_STORAGES_PER_BATCH).  The receiver makes room for exactly these.
MAX_FDS = 64


class ChannelClosed(EOFError):
    """The peer closed its end (it exited or died)."""


class Channel:
    """One end of a worker's control socket."""

    def __init__(self, sock: socket.socket, parent_side: bool = False):
        self.sock = sock
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0
        self._held: list[bytes] | None = None  # messages kept for one send (hold / flush)
        if parent_side:
            register_parent_only(self)

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """(the main process's end, the socket to hand to the worker)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(parent, parent_side=True), child

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message, fds: tuple[int, ...] = ()) -> None:
        """Send one protocol message (and `fds` with it); while held, a message without fds
        waits for flush()."""
        if len(fds) > MAX_FDS:
            raise SlotProtocolError(f"a control message with {len(fds)} fds; the channel carries at most {MAX_FDS}")
        payload = pickle.dumps(encode(message), protocol=pickle.HIGHEST_PROTOCOL)
        frame = _FRAME.pack(len(payload), len(fds))
        if fds:
            self.flush()  # the order of messages stays the order of sends
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            self.sock.sendmsg([frame], ancillary)
            self.sock.sendall(payload)
        elif self._held is not None:
            self._held.append(frame + payload)
        else:
            self.sock.sendall(frame + payload)
        self.bytes_sent += len(frame) + len(payload)
        self.messages_sent += 1

    def hold(self) -> None:
        """Keep the messages sent from now on until flush(), to send them in one write: the
        main process's task and grant for a worker wake it once, not twice."""
        if self._held is None:
            self._held = []

    def flush(self) -> None:
        """Send the held messages, and stop holding."""
        held, self._held = self._held, None
        if held:
            self.sock.sendall(b"".join(held))

    def recv(self) -> tuple[Any, list[int]]:
        """The next message and the fds that came with it (the caller owns them; if no whole
        message arrives, those that did are closed here).  A message whose fds did not all
        arrive is read whole, so the next one is read from its start, and refused."""
        fds: list[int] = []
        try:
            frame = bytearray()
            truncated = False
            while len(frame) < _FRAME.size:
                data, ancillary, flags, _addr = self.sock.recvmsg(
                    _FRAME.size - len(frame), socket.CMSG_SPACE(MAX_FDS * 4)
                )
                truncated = truncated or bool(flags & socket.MSG_CTRUNC)
                for level, kind, blob in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(blob[: len(blob) - len(blob) % got.itemsize])
                        fds.extend(got)
                if not data:
                    raise ChannelClosed("the peer closed the control socket")
                frame += data
            length, nfds = _FRAME.unpack(frame)
            payload = bytearray(length)
            view = memoryview(payload)
            received = 0
            while received < length:
                n = self.sock.recv_into(view[received:], length - received)
                if n == 0:
                    raise ChannelClosed("the peer closed the control socket mid-message")
                received += n
            if nfds != len(fds) or truncated:
                raise SlotProtocolError(f"a control message announced {nfds} fds and {len(fds)} arrived "
                                        f"(this end takes at most {MAX_FDS})")
            message = decode(pickle.loads(payload))
        except BaseException:
            for fd in fds:
                _close_quietly(fd)
            raise
        self.bytes_received += _FRAME.size + length
        self.messages_received += 1
        return message, fds

    def close(self) -> None:
        with no_fork_meanwhile():
            self.sock.close()

    def close_in_child(self) -> None:
        self.sock.close()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
