"""The door of the OpenAI app, before FastAPI parses anything: the API key on every /v1/ route (OpenAI's
`Authorization: Bearer <key>` or Anthropic's `x-api-key: <key>`), and the
request body read in full within a size cap and a time limit (413 past the cap, checked from the
Content-Length header before a byte is read; 408 when the body trickles in too slowly), so a huge or slow
body can neither fill memory nor hold an event loop. A plain ASGI middleware: streamed responses pass
through it untouched."""
from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

# (status, message, code) -> the error body; a route with its own error format (Anthropic's) names its own.
ErrorBody = Callable[[int, str, str], dict]

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


class RequestGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
                 error_bodies: dict[str, ErrorBody] | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.error_bodies = error_bodies or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"].startswith("/v1/") and not self._authorized(scope):
            return await self._error(scope, send, 401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                     "<key>' or 'x-api-key: <key>'", "invalid_api_key", {"www-authenticate": "Bearer"})
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            return await self._error(scope, send, 413, self._too_large(), "request_too_large")
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_read_timeout_s)
        except _BodyTooLarge:
            return await self._error(scope, send, 413, self._too_large(), "request_too_large")
        except _ClientGone:
            return None
        except asyncio.TimeoutError:
            return await self._error(scope, send, 408, "The request body did not arrive within "
                                     f"{self.body_read_timeout_s:.0f} s", "request_timeout")
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.api_key):
                return True
        return False

    async def _error(self, scope, send, status: int, message: str, code: str,
                     headers: dict[str, str] | None = None) -> None:
        render = self.error_bodies.get(scope["path"], _openai_error_body)
        await _error(send, status, render(status, message, code), headers)

    def _too_large(self) -> str:
        return f"The request body is larger than this server's limit of {self.max_body_bytes} bytes"

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive):
    """The body as one message, then the client's own messages (its disconnect, for the handlers)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _openai_error_body(status: int, message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


async def _error(send, status: int, error_body: dict, headers: dict[str, str] | None = None) -> None:
    """An error body, written without the app (nothing of the request was parsed)."""
    body = json.dumps(error_body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if status in (408, 413):
        raw_headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
