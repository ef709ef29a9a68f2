"""The wire between a writer and its persisting process (`persist.process`): messages of
JSON (never pickle) over a Unix socket pair, each an 8-byte length then the body, and a
file descriptor passed alongside where a message says one follows (the shared-memory segment
of a snapshot). Reads take exactly one message's bytes, so a descriptor sent after a message
is received by the next read of one byte."""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

_MAX = 256 << 20  # a request names files and a manifest's fields: far below this
_FD_MARK = b"F"


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
