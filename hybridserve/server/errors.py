"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports, from a malformed body to an engine fault, goes
through :class:`APIError` or one of the handlers here, so clients always get the same
shape and a status that says whose fault it was (4xx: the request, 5xx: the server).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "server_error",
}


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message may quote the client's own text (a field
    name, a model name), which can hold lone surrogates that UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


class APIError(Exception):
    """An error to report to one client; ``param`` names the offending field, if any."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return ErrorResponse(self.body(), status_code=self.status, headers=headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def param_from_message(message: str, fields: set[str]) -> str | None:
    """The field a validation message starts with (``"top_p must be ..."`` -> ``top_p``;
    ``"structured_outputs.regex does not ..."`` -> ``structured_outputs``)."""
    head = message.split(" ", 1)[0].split("=", 1)[0].split(".", 1)[0].rstrip(":")
    return head if head in fields else None


def _loc_name(loc: tuple[Any, ...]) -> str:
    # Drop the leading "body" and pydantic's union-member tags ("list[int]", "str")
    # so the name is the client's own path into the JSON, e.g. "messages.0.role".
    parts = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and ("[" in item or item in ("str", "int", "float", "bool")):
            continue
        else:
            parts.append(str(item))
    return ".".join(parts)


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's validation report into one 400 that names the fields."""
    by_field: dict[str, list[str]] = {}
    for err in exc.errors():
        kind = err.get("type", "")
        name = _loc_name(tuple(err.get("loc", ())))
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return APIError(
                400,
                f"the request body is not valid JSON: {detail}".rstrip(": "),
                code="invalid_json",
            )
        if not name:
            if kind == "missing":
                return APIError(400, "the request needs a JSON object body", code="missing_body")
            return APIError(
                400,
                "the request body must be a JSON object sent with Content-Type: application/json",
                code="invalid_body",
            )
        if kind == "extra_forbidden":
            text = "unsupported field; this server does not accept it"
        elif kind == "missing":
            text = "required field is missing"
        else:
            text = err.get("msg", "invalid value")
        msgs = by_field.setdefault(name, [])
        if text not in msgs:
            msgs.append(text)
    # A union (e.g. ``prompt``) reports one error per alternative: join a few of them.
    parts = [f"{name}: {'; or '.join(msgs[:4])}" for name, msgs in list(by_field.items())[:4]]
    return APIError(
        400,
        "; ".join(parts) or "invalid request",
        param=next(iter(by_field), None),
        code="invalid_value",
    )


async def handle_api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def handle_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def handle_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = str(exc.detail) if exc.detail else "error"
    err = APIError(exc.status_code, message, code=code)
    resp = err.response()
    if exc.headers:
        resp.headers.update(exc.headers)
    return resp
