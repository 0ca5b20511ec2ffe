"""A small HTTP/1.1 server that no client can hold up: the transport of argus's SQL endpoints.

Both the query service (:mod:`argus.sinks.query_service`) and the sink's backend
(:mod:`argus.sinks.query_server`) run on it. It runs an asyncio loop in a daemon thread of its own:
see docs/query-service.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, urlsplit

__all__ = ["MAX_HEAD_BYTES", "BoundedHttpServer", "Request", "Response"]

log = logging.getLogger(__name__)

#: Largest request line plus headers, bytes.
MAX_HEAD_BYTES = 64 * 1024
_WRITE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Request:
    """One HTTP request, read whole: ``path`` without its query string, ``params`` the URL's query parameters
    in order (decoded), ``headers`` with lower-case names (a repeated header keeps its last value)."""

    method: str
    path: str
    params: tuple[tuple[str, str], ...]
    headers: dict[str, str]
    body: bytes
    #: When the request's deadline ends, in ``time.monotonic()`` seconds.
    deadline: float

    def param(self, name: str) -> str | None:
        """The last value of URL parameter ``name`` (``None`` if absent)."""
        found = None
        for key, value in self.params:
            if key == name:
                found = value
        return found


@dataclass
class Response:
    """An answer: status, headers (``Content-Length`` and ``Connection`` are added) and the whole body."""

    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: Close the connection after this answer (set for errors whose request may not have been read whole).
    close: bool = False


Handler = Callable[[Request], Response]


class BoundedHttpServer:
    """Serves ``handler`` on ``host:port`` (0: any free port, see :attr:`port`) from a thread of its own.

    Args:
        fast: answers made on the event loop, for requests that need no work (``None``: give it to ``handler``).
        max_connections: connections open at once; more are answered ``503`` and closed.
        request_deadline_s: seconds a client has to send a whole request (and an idle connection to send the
            next one).
        max_body_bytes: largest request body; a larger ``Content-Length`` is answered ``413``.
        workers: requests handled at once by ``handler``.
        queue_wait_s: longest wait for a free worker, seconds (within the request's deadline as well).

    Raises:
        OSError: the address cannot be bound (raised by the constructor, not the thread).
    """

    def __init__(self, host: str, port: int, handler: Handler, *, fast: Callable[[Request], Response | None],
                 max_connections: int, request_deadline_s: float, max_body_bytes: int, workers: int,
                 queue_wait_s: float, name: str) -> None:
        self.handler, self.fast, self.name = handler, fast, name
        self.max_connections, self.request_deadline_s = max_connections, request_deadline_s
        self.max_body_bytes, self.queue_wait_s = max_body_bytes, queue_wait_s
        self.open_connections = 0
        #: Connections refused because ``max_connections`` were open, and requests cut at their deadline.
        self.refused_connections = 0
        self.timed_out_requests = 0
        self._slots = asyncio.Semaphore(workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-worker")
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, host, port, limit=MAX_HEAD_BYTES, backlog=256))
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close the listening socket and the loop (requests in flight are dropped)."""
        if self._thread.is_alive():
            async def close() -> None:
                self._server.close()
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._loop.is_running():
            self._loop.close()

    # -- one connection ----------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.max_connections:
            self.refused_connections += 1
            await self._refuse_connection(reader, writer)
            return
        self.open_connections += 1
        try:
            while True:
                deadline = time.monotonic() + self.request_deadline_s
                try:
                    async with asyncio.timeout(self.request_deadline_s):
                        request = await self._read(reader, deadline)
                except TimeoutError:
                    self.timed_out_requests += 1
                    break
                except _BadRequestError as exc:
                    await self._write(writer, Response(exc.status, exc.message.encode() + b"\n", close=True))
                    break
                if request is None:
                    break
                response = self.fast(request) if self.fast is not None else None
                if response is None:
                    response = await self._handle(request)
                close = response.close or request.headers.get("connection", "").lower() == "close"
                response.close = close
                await self._write(writer, response, head_only=request.method == "HEAD")
                if close:
                    break
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection lost: %s", self.name, exc)
        except asyncio.CancelledError:
            pass  # the server stops: end quietly (asyncio's stream callback chokes on a cancelled task)
        finally:
            self.open_connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _refuse_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b"too many connections; try again\n"
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=UTF-8\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s" % (len(body), body))
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await writer.drain()
        with contextlib.suppress(Exception):  # what the client sent already: unread, closing would reset
            async with asyncio.timeout(0.05):
                await reader.read(MAX_HEAD_BYTES)
        writer.close()

    async def _read(self, reader: asyncio.StreamReader, deadline: float) -> Request | None:
        """The next request, ``None`` when the client closed the connection between requests."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial.strip():
                return None
            raise _BadRequestError(HTTPStatus.BAD_REQUEST, "incomplete request") from exc
        except asyncio.LimitOverrunError as exc:
            raise _BadRequestError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                              f"request head over {MAX_HEAD_BYTES} bytes") from exc
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
        except ValueError as exc:
            raise _BadRequestError(HTTPStatus.BAD_REQUEST, "malformed request line") from exc
        if not version.startswith("HTTP/1."):
            raise _BadRequestError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "HTTP/1.x only")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise _BadRequestError(HTTPStatus.BAD_REQUEST, "malformed header")
                headers[name.lower()] = value.strip()
        body = await self._read_body(reader, headers, method.upper() == "POST")
        url = urlsplit(target)
        try:
            params = tuple(parse_qsl(url.query, keep_blank_values=True, strict_parsing=False, errors="strict"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _BadRequestError(HTTPStatus.BAD_REQUEST, "URL parameters must be UTF-8") from exc
        return Request(method.upper(), url.path, params, headers, body, deadline)

    async def _read_body(self, reader: asyncio.StreamReader, headers: dict[str, str], post: bool) -> bytes:
        if "transfer-encoding" in headers:
            raise _BadRequestError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length, not chunked")
        raw = headers.get("content-length")
        if raw is None:
            if post:  # the body would run into the next request
                raise _BadRequestError(HTTPStatus.LENGTH_REQUIRED, "a POST needs a Content-Length")
            return b""
        if not raw.isascii() or not raw.isdigit():
            raise _BadRequestError(HTTPStatus.LENGTH_REQUIRED, "Content-Length must be a non-negative integer")
        length = int(raw)
        if length > self.max_body_bytes:
            raise _BadRequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {self.max_body_bytes} bytes")
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise _BadRequestError(HTTPStatus.BAD_REQUEST, "body shorter than its Content-Length") from exc

    async def _handle(self, request: Request) -> Response:
        """Run ``handler`` on a free worker; ``503`` when none frees up in time."""
        wait_s = max(0.001, min(self.queue_wait_s, request.deadline - time.monotonic()))
        try:
            async with asyncio.timeout(wait_s):
                await self._slots.acquire()
        except TimeoutError:
            return Response(HTTPStatus.SERVICE_UNAVAILABLE, b"all query slots are busy; try again\n",
                            [("Retry-After", "1")])
        try:
            return await asyncio.wrap_future(self._pool.submit(self._run, request))
        finally:
            self._slots.release()

    def _run(self, request: Request) -> Response:
        try:
            return self.handler(request)
        except Exception:  # a handler's bug must answer this request, not kill the connection's coroutine
            log.exception("%s: handler failed", self.name)
            return Response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n", close=True)

    async def _write(self, writer: asyncio.StreamWriter, response: Response, head_only: bool = False) -> None:
        status = HTTPStatus(response.status)
        head = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Length: {len(response.body)}",
                f"Connection: {'close' if response.close else 'keep-alive'}", "X-Content-Type-Options: nosniff",
                "Cache-Control: no-store"]
        head += [f"{k}: {v}" for k, v in response.headers]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(response.body)
        async with asyncio.timeout(_WRITE_TIMEOUT_S):  # a client that stops reading frees its connection too
            await writer.drain()


class _BadRequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
