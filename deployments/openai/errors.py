"""Every failure as OpenAI's error body `{"error": {message, type, param, code}}` with the right HTTP status:
the exception the handlers raise, and the FastAPI exception handlers that render it."""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.sampling_params import SamplingParamsError
from engine.structured_output import StructuredOutputError

from .responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
                503: "service_unavailable_error"}
# Pydantic names union members and validator kinds in error locations; they are not request fields.
_NOT_A_FIELD = re.compile(r"[\[\-]|^(str|int|float|bool|list|dict|none|[A-Z]\w*)$")


class OpenAIError(Exception):
    """An error to send to the client as OpenAI's error body."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        error_type = _ERROR_TYPES.get(self.status_code, "invalid_request_error" if self.status_code < 500
                                      else "internal_server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=error_type, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.body().model_dump(), status_code=self.status_code, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    """Escapes non-ASCII: an error that quotes the client's input (a model name with a lone surrogate, say)
    still renders, where UTF-8 encoding would fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist", "model", "model_not_found")


def too_many_requests(in_flight: int, limit: int) -> OpenAIError:
    return OpenAIError(429, f"The server runs {in_flight} sequences of its limit of {limit}; retry in a moment",
                       code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def engine_unavailable(detail: str = "the engine is not running") -> OpenAIError:
    return OpenAIError(503, f"The model is unavailable: {detail}", code="engine_unavailable",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def from_exception(exc: BaseException) -> OpenAIError:
    """Map an exception raised while serving a request to the error the client sees."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, (SamplingParamsError, StructuredOutputError)):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), "prompt")
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, RequestFailedError):  # this request alone; the engine serves on
        return OpenAIError(500, f"The request failed: {exc}", code="request_failed")
    logger.error("request failed", exc_info=exc)
    return OpenAIError(500, f"Internal server error: {type(exc).__name__}: {exc}")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "The request body is invalid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    messages, param = [], None
    for error in errors[:3]:
        path = ".".join(str(part) for part in error.get("loc", ()) if part != "body"
                        and not (isinstance(part, str) and _NOT_A_FIELD.search(part)))
        param = param or path or None
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        messages.append(f"'{path}': {message}" if path else message)
    if len(errors) > 3:
        messages.append(f"and {len(errors) - 3} more")
    return "Invalid request: " + "; ".join(dict.fromkeys(messages)), param


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = OpenAIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return error.response()

    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(Exception, on_unexpected_error)
