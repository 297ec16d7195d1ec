"""Test helper: an AgentGym-protocol server (uvicorn) in a daemon thread on a loopback port."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from env_adapters.base import TextEnv, format_error


class ServerThread:
    """uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, app, port: int = 0, **uvicorn_kw):
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto is TCP; with proto 0, Nagle + delayed ACK add ~40 ms to every response
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))  # a given port: a server restarted where it was
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2, **uvicorn_kw)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            assert self.thread.is_alive(), "server thread died during startup"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.thread.is_alive():  # pragma: no cover - last resort
            self.server.force_exit = True
            self.thread.join(timeout=5)
        self.sock.close()
        assert not self.thread.is_alive()



class EchoEnv(TextEnv):
    """An adapter that quotes the reply in its observation, as error messages often do."""

    name = "echo"

    def reset(self, task_id, seed=0):
        return "say something", {}

    def step(self, action_text):
        return format_error(f"Not an action: {action_text}")
