"""Control messages between the ranks' NCCL-rules harnesses (``nccl_rules``), over TCP.

The harness's data moves through gloo; its control traffic (a rank's op reached the head of
its queue, "send me your pending ops", "a hang was reported") goes through plain sockets,
because a rank must answer while its main thread sits in a gloo collective, and a gloo
receive cannot be waited on with a timeout and then waited on again (the process dies), so a
gloo listener could not be stopped cleanly at the end of a run. Sockets give a listener
thread that ``select``s over every peer, stops on request and sees a peer that went away.

Messages are pickled tuples (the peers are this run's own processes), each framed by its
length. Every rank listens on one port, published in the run's store; a rank connects to a
peer on its first message to it and says who it is (``("hello", rank)``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import socket
import struct
import threading
from collections.abc import Callable

_LENGTH = struct.Struct("!I")

Message = tuple


def _listen_host(world_size: int) -> str:
    """Loopback when the whole world is on this machine (torchrun's LOCAL_WORLD_SIZE), so
    nothing outside it can connect; else this machine's name."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or int(local) == world_size:
        return "127.0.0.1"
    return socket.gethostname()


class Wire:
    """One rank's end: a listener thread that hands each message to ``on_message(peer,
    message)`` and reports a peer whose connection closed to ``on_gone(peer)``; ``send``
    to a peer from any thread."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        on_message: Callable[[int, Message], None],
        on_gone: Callable[[int], None],
    ) -> None:
        self.rank = rank
        self._on_message = on_message
        self._on_gone = on_gone
        self._server = socket.create_server((_listen_host(world_size), 0))
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._peers: dict[int, tuple[str, int]] = {}
        self._out: dict[int, socket.socket] = {}
        self._send_lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._server, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nccl-rules-wire", daemon=True)

    def start(self, peers: dict[int, tuple[str, int]]) -> None:
        """Listen, knowing every peer's address (read from the store by the caller)."""
        self._peers = dict(peers)
        self._thread.start()

    def send(self, peer: int, message: Message) -> bool:
        """Send ``message`` to ``peer``; False when the peer cannot be reached (gone)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                connection = self._out.get(peer)
                if connection is None:
                    connection = socket.create_connection(self._peers[peer], timeout=30)
                    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    hello = pickle.dumps(("hello", self.rank))
                    connection.sendall(_LENGTH.pack(len(hello)) + hello)
                    self._out[peer] = connection
                connection.sendall(_LENGTH.pack(len(data)) + data)
                return True
            except OSError:
                self._out.pop(peer, None)
                return False

    def close(self) -> None:
        """Stop the listener and close every connection."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        with self._send_lock:
            for connection in self._out.values():
                connection.close()
            self._out.clear()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_write.close()

    # --- the listener -------------------------------------------------------------------

    def _run(self) -> None:
        buffers: dict[socket.socket, bytearray] = {}
        senders: dict[socket.socket, int] = {}
        while not self._stopping:
            for key, _ in self._selector.select():
                if key.data == "wake":
                    return
                if key.data == "accept":
                    connection, _ = self._server.accept()
                    self._selector.register(connection, selectors.EVENT_READ, "peer")
                    buffers[connection] = bytearray()
                    continue
                connection = key.fileobj  # type: ignore[assignment]
                try:
                    chunk = connection.recv(1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._selector.unregister(connection)
                    connection.close()
                    buffers.pop(connection, None)
                    if connection in senders and not self._stopping:
                        self._on_gone(senders.pop(connection))
                    continue
                buffer = buffers[connection]
                buffer += chunk
                for message in _complete_messages(buffer):
                    if message[0] == "hello":
                        senders[connection] = message[1]
                    else:
                        self._on_message(senders[connection], message)


def _complete_messages(buffer: bytearray) -> list[Message]:
    """The whole messages at the start of ``buffer``, removed from it."""
    messages = []
    while len(buffer) >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer)
        if len(buffer) < _LENGTH.size + length:
            break
        messages.append(pickle.loads(bytes(buffer[_LENGTH.size : _LENGTH.size + length])))
        del buffer[: _LENGTH.size + length]
    return messages
