"""The HTTP sidecar every role serves: health, readiness, status, metrics and control.

Routes only translate: parse the request, call one method of the role's control object, map the
result or the domain error to HTTP. Waiting, pausing and coordination live in the role.

    GET  /healthz /readyz /status /metrics /checkpoints
    POST /checkpoint /episode/start /episode/stop   (bearer token when one is configured)

A role may add routes of its own (``RoleSpec.routes``: the serving role's ``POST /predict``), on
the same terms.
"""
from __future__ import annotations

import hmac
import math
from typing import Any, Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from services.control import Controllable, EpisodeStart
from services.lease import LEASE_HEADER, Ask, Lease
from services.errors import (BadRequest, CheckpointError, CheckpointInProgress, EpisodeConflict, InvalidInput,
                             NotReady, NotSupported, Overloaded, PeerUnavailable, RpcpsError, TooLarge, Unauthorized)

# The first type an error is an instance of gives its status: the narrower ones come first.
_STATUS = {InvalidInput: 422, TooLarge: 413, BadRequest: 400, Unauthorized: 401, EpisodeConflict: 409,
           CheckpointInProgress: 409, NotReady: 503, Overloaded: 503, NotSupported: 501, PeerUnavailable: 503,
           CheckpointError: 500}


class ErrorBody(BaseModel):
    """Every error answer, whatever raised it."""

    error: str
    type: str


def error_answers(*codes: int) -> dict:
    """The error answers a route really gives, for its OpenAPI entry."""
    what = {400: "a bad request", 401: "missing or wrong bearer token", 409: "conflicts with what runs",
            413: "a body over the size limit", 422: "a body that is not the documented JSON",
            500: "failed on the serving side",
            501: "this role does not offer it", 503: "not joined, or a peer it needs is unavailable"}
    return {code: {"model": ErrorBody, "description": what[code]} for code in codes}


class FiniteJSON(JSONResponse):
    """JSON that any client parses: a value that is not a finite number (a NaN loss before the
    first step) is ``null``, where the standard encoder would fail the whole answer."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:
            return super().render(_finite(content))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_CONTROL = (401, 501, 503)   # every POST: the token, roles without the operation, not joined yet


Routes = Callable[[FastAPI, Any], None]     # adds a role's own routes, each calling the control object


def create_app(control: Controllable, registry: CollectorRegistry, token: Optional[str] = None,
               routes: Optional[Routes] = None, lease: Optional[Lease] = None) -> FastAPI:
    """The sidecar of ``control``; ``lease``: renewed by a ``/healthz`` that carries its header
    (``services/lease.py``)."""
    app = FastAPI(title="rpcps sidecar", docs_url=None, redoc_url=None, default_response_class=FiniteJSON)
    _error_answers(app)
    _probes(app, control, registry, lease)
    app.state.guarded = [Depends(_bearer(token))]      # for a role's own POST routes (``guarded``)
    _control_routes(app, control, _bearer(token))
    if routes is not None:
        routes(app, control)
    return app


def guarded(app: FastAPI) -> list[Any]:
    """The dependencies a role's own POST route takes to be guarded by the control token, as the
    sidecar's own are."""
    return list(app.state.guarded)


def _bearer(token: Optional[str]) -> Callable[[Request], None]:
    """The dependency that guards the POST routes with ``token`` (none: open)."""
    def require_token(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        # Constant-time compare so the token cannot be guessed byte by byte from timings.
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("missing or wrong bearer token (set Authorization: Bearer <RPCPS_CONTROL_TOKEN>)")
    return require_token


def _error_answers(app: FastAPI) -> None:
    """Every failure answered in the one documented shape, ``{"error", "type"}``."""
    @app.exception_handler(RpcpsError)
    def _domain_error(_: Request, exc: RpcpsError) -> JSONResponse:
        code = next((c for t, c in _STATUS.items() if isinstance(exc, t)), 500)
        return JSONResponse({"error": str(exc), "type": type(exc).__name__}, status_code=code)

    @app.exception_handler(RequestValidationError)
    def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"error": "invalid request: " + "; ".join(msgs), "type": "BadRequest"}, status_code=422)

    @app.exception_handler(HTTPException)
    def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own answers (unknown path, wrong method, an unreadable body) in our shape.
        return JSONResponse({"error": str(exc.detail), "type": "".join(str(exc.detail).title().split())},
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    def _bug(_: Request, exc: Exception) -> JSONResponse:
        # A failure nobody foresaw is still an answer in the documented shape (Starlette raises it
        # again after this answer, so uvicorn logs its trace).
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"[:500], "type": "InternalError"},
                            status_code=500)


def _probes(app: FastAPI, control: Controllable, registry: CollectorRegistry, lease: Optional[Lease]) -> None:
    """What anyone may read: health, readiness, status, metrics, the checkpoints on disk."""
    probe = {503: {"description": "not healthy or not ready; the body says why"}}

    @app.get("/healthz", responses=probe)
    def healthz(request: Request) -> JSONResponse:
        if lease is not None and LEASE_HEADER in request.headers:
            lease.renew(Ask.parse(request.headers[LEASE_HEADER]))
        ok, reason = control.healthy()
        body = {"ok": ok, "reason": reason}
        if lease is not None:       # whether its supervisor still asks: a member about to fence itself shows it
            body["lease"] = lease.describe()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/readyz", responses=probe)
    def readyz() -> JSONResponse:
        ok, reason = control.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/status")
    def status() -> dict:
        return control.status()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/checkpoints", responses=error_answers(500))
    def checkpoints() -> dict:
        return {"checkpoints": control.list_checkpoints()}


def _control_routes(app: FastAPI, control: Controllable, require_token: Callable[[Request], None]) -> None:
    """The POST routes, each a call on the role's control object, guarded by ``require_token``."""
    guarded = [Depends(require_token)]

    @app.post("/checkpoint", dependencies=guarded, responses=error_answers(*_CONTROL, 409, 500))
    def checkpoint() -> dict:
        return control.checkpoint()

    @app.post("/episode/start", dependencies=guarded, responses=error_answers(*_CONTROL, 400, 409, 422))
    def episode_start(body: Optional[EpisodeStart] = None) -> dict:
        return control.start_episode(body or EpisodeStart())

    @app.post("/episode/stop", dependencies=guarded, responses=error_answers(*_CONTROL, 409))
    def episode_stop() -> dict:
        return control.stop_episode()
