"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from http import HTTPStatus

import orjson
from aiohttp import web

_TYPE_BY_STATUS = {
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with `status` and an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status) or (
            "invalid_request_error" if status < 500 else "server_error")
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(error: ValueError, default_param: str | None = None) -> APIError:
    """A 400 whose `param` is the field a `SamplingParams`-style message starts with ("top_p must ...")."""
    message = str(error)
    field, _, rest = message.partition(" ")
    param = field if rest.startswith("must") else default_param
    return bad_request(message, param)


def from_http_exception(error: web.HTTPException) -> APIError:
    """aiohttp's own errors (404 route, 405 method, 413 body) as OpenAI error objects."""
    status = error.status
    if status == 413:
        return APIError(413, f"request body too large: {error.text or ''}".strip(), code="request_too_large")
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = error.reason
    return APIError(status, reason, code={404: "not_found", 405: "method_not_allowed"}.get(status))
