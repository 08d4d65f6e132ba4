"""The compile workers' message format: a pickle behind its length (8 bytes, little-endian).

One format for every channel of ``compile_pool.py`` and ``fork_server.py``: the pipes between the
compiling process and a worker (or the fork server's stdin), read as streams, and the fork
server's socket, read with ``recv`` (the socket also carries file descriptors, so no buffered
reader may read ahead on it).
"""
from __future__ import annotations

import pickle
import socket
import struct
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def send(stream: BinaryIO, obj: Any) -> None:
    stream.write(frame(obj))
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next message of ``stream``; EOFError once it is closed."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("compile worker pipe closed")
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("compile worker pipe closed mid-message")
    return pickle.loads(data)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the fork server's socket closed")
        data += chunk
    return data


def receive_from_socket(sock: socket.socket) -> Any:
    return pickle.loads(recv_exact(sock, _HEADER.unpack(recv_exact(sock, _HEADER.size))[0]))
