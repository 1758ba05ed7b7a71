"""The sender's connection to a receiver: a plain non-blocking socket, or an asyncio stream for TLS.

Plain TCP uses ``loop.sock_sendall`` on the socket itself: it sends from the caller's buffer (a view
of the KV tensors) without copying it into a user-space write buffer, which asyncio's stream writer
does for whatever the kernel does not take at once (and that copy dominated loopback transfers).
TLS needs the stream layer (the bytes must be encrypted anyway, so the copy is inherent).
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_module


class SocketConnection:
    """A connected non-blocking TCP socket driven by the running loop."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    async def send(self, data) -> None:
        """Send all of ``data`` (any buffer)."""
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def recv_exactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes. Raises asyncio.IncompleteReadError if the peer closes first."""
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        loop = asyncio.get_running_loop()
        while got < n:
            k = await loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
            got += k
        return bytes(buf)

    def usable(self) -> bool:
        """True if the idle connection is still open and has nothing unread."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: open and idle
        except OSError:
            return False
        return False  # end of stream, or bytes nobody asked for: do not reuse

    def close(self) -> None:
        self.sock.close()


class StreamConnection:
    """An asyncio stream (used for TLS)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def send(self, data) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv_exactly(self, n: int) -> bytes:
        return await self.reader.readexactly(n)

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


async def open_connection(host: str, port: int, *, ssl: ssl_module.SSLContext | None = None,
                          server_hostname: str | None = None) -> SocketConnection | StreamConnection:
    """Connect to ``host:port`` (TLS when ``ssl`` is given).

    Raises:
        OSError, ssl.SSLError: the connection or the TLS handshake failed.
    """
    if ssl is not None:
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl, server_hostname=server_hostname)
        return StreamConnection(reader, writer)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
            return SocketConnection(sock)
        except OSError as exc:
            sock.close()
            last = exc
    raise last or OSError(f"no address for {host}:{port}")
