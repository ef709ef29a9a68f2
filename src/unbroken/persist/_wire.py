"""The wire between a writer and its persisting process (`persist.process`): messages of
JSON (never pickle) over a Unix socket pair, each an 8-byte length then the body, and a
file descriptor passed alongside where a message says one follows (the shared-memory segment
of a snapshot). Reads take exactly one message's bytes, so a descriptor sent after a message
is received by the next read of one byte.

The segment's first `HEAD` bytes are a flag the writer sets and the persisting process
polls (`hurry`, `hurried`); the snapshot follows them."""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
from typing import Any

_MAX = 256 << 20  # a request names files and a manifest's fields: far below this
_FD_MARK = b"F"
HEAD = 64  # the segment's first bytes: the newest save to hurry (`hurry`), then the snapshot


class Closed(EOFError):
    """The other side closed the socket (ended or died)."""


def send(sock: socket.socket, message: dict[str, Any], fd: int | None = None) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("<Q", len(body)) + body)
    if fd is not None:
        socket.send_fds(sock, [_FD_MARK], [fd])


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise Closed("the other side closed the connection")
        out += chunk
    return bytes(out)


def receive(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", _exactly(sock, 8))
    if n > _MAX:
        raise ValueError(f"a message of {n} bytes, over the {_MAX}-byte limit")
    message = json.loads(_exactly(sock, n))
    if not isinstance(message, dict):
        raise ValueError("a message that is not a JSON object")
    return message


def receive_fd(sock: socket.socket) -> int:
    """The descriptor sent after the last message (`send` with ``fd``)."""
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if data != _FD_MARK or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise Closed("the descriptor that should follow the message did not arrive")
    return fds[0]


def hurry(segment: mmap.mmap | memoryview, seq: int) -> None:
    """(The writer.) The number of the newest save its loop waits for: a paced persisting
    process goes on at full speed once `hurried` says it (0: none)."""
    struct.pack_into("<Q", segment, 0, seq)


def hurried(segment: mmap.mmap) -> int:
    """(The persisting process.) The number the writer last set with `hurry`."""
    return int(struct.unpack_from("<Q", segment, 0)[0])
