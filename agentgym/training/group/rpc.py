"""The resident group's channel between the driver and its ranks.

``multiprocessing.connection`` does the transport: message framing, and an HMAC challenge with
a per-group ``authkey`` when a rank connects (a stray or foreign connection fails it). Payloads
are ``torch.save`` bytes loaded with ``weights_only=True`` rather than the module's pickles, so
even an authenticated peer can only send plain values and tensors.
"""

from __future__ import annotations

import io
import queue
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing import connection as _connection
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, cast

import torch

AUTHKEY_ENV = "AGENTGYM_GROUP_AUTHKEY"  # how the ranks get the key (hex): not on the command line

__all__ = ["AUTHKEY_ENV", "Client", "Connection", "RankAcceptor", "plain", "recv", "send", "wait"]


def send(conn: Connection, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    conn.send_bytes(buf.getbuffer())


def recv(conn: Connection) -> Any:
    """One message; raises ``EOFError`` when the peer has gone."""
    return torch.load(io.BytesIO(conn.recv_bytes()), weights_only=True)


def wait(conns: list[Connection], timeout: float | None) -> list[Connection]:
    """``multiprocessing.connection.wait`` over connections: those of ``conns`` ready to read
    (it returns objects it was given; typeshed types them as any waitable)."""
    return cast(list[Connection], _connection.wait(conns, timeout))


def plain(obj: Any) -> Any:
    """Make a reply loadable with ``weights_only=True`` (no numpy scalars and such)."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool, type(None), torch.Tensor)):
        return obj
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


class RankAcceptor:
    """Accepts the ranks' connections and reads each one's hello ``{rank, pid, host}``.

    ``Listener.accept`` has no timeout, so it runs on a thread and hands connections over a
    queue: the driver meanwhile watches the launcher and its deadline.
    """

    def __init__(self, host: str, authkey: bytes, backlog: int, port: int = 0):
        # port 0: any free one (the ranks are told it); a fixed one for ranks on other nodes
        self.listener = Listener((host, port), backlog=max(1, backlog), authkey=authkey)
        self.address: tuple[str, int] = self.listener.address
        self._got: queue.Queue[tuple[dict, Connection]] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="agentgym-group-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AuthenticationError):  # a foreign connection, or closed
                continue
            try:
                hello = recv(conn) if conn.poll(30) else None
            except (OSError, EOFError, RuntimeError):  # not one of our ranks
                hello = None
            if not isinstance(hello, dict) or "rank" not in hello:
                conn.close()
                continue
            self._got.put((hello, conn))

    def get(self, timeout: float) -> tuple[dict, Connection] | None:
        try:
            return self._got.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # wake the thread blocked in accept(): this connection then fails the handshake
            socket.create_connection(self.address, timeout=2).close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self.listener.close()
