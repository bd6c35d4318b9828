"""A TCP proxy to the API server that can go dark: after ``go_dark`` it relays nothing more,
and new connections are accepted and never answered (what a partitioned API server looks like
to its clients: requests that neither succeed nor fail)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Blackhole:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.dark = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def go_dark(self) -> None:
        self.dark.set()

    def close(self) -> None:
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            if self.dark.is_set():
                continue  # held open, never answered
            upstream = socket.create_connection(self.target)
            self._sockets.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.dark.is_set():
                self.dark.wait()  # swallow: the peer sees a silent connection
                continue
            try:
                dst.sendall(data)
            except OSError:
                return
