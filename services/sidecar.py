"""The HTTP sidecar every role serves: health, readiness, status, metrics and control.

Routes only translate: parse the request, call one method of the role's control object, map the
result or the domain error to HTTP. Waiting, pausing and coordination live in the role.

    GET  /healthz /readyz /status /metrics /checkpoints
    POST /checkpoint /episode/start /episode/stop   (bearer token when one is configured)
"""
from __future__ import annotations

import hmac
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.control import Controllable, EpisodeStart
from services.errors import (BadRequest, CheckpointError, CheckpointInProgress, EpisodeConflict, NotReady,
                             NotSupported, PeerUnavailable, RpcpsError, Unauthorized)

_STATUS = {BadRequest: 400, Unauthorized: 401, EpisodeConflict: 409, CheckpointInProgress: 409, NotReady: 503,
           NotSupported: 501, PeerUnavailable: 503, CheckpointError: 500}


def create_app(control: Controllable, registry: CollectorRegistry, token: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="rpcps sidecar", docs_url=None, redoc_url=None)

    def require_token(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        # Constant-time compare so the token cannot be guessed byte by byte from timings.
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("missing or wrong bearer token (set Authorization: Bearer <RPCPS_CONTROL_TOKEN>)")

    @app.exception_handler(RpcpsError)
    def _domain_error(_: Request, exc: RpcpsError) -> JSONResponse:
        code = next((c for t, c in _STATUS.items() if isinstance(exc, t)), 500)
        return JSONResponse({"error": str(exc), "type": type(exc).__name__}, status_code=code)

    @app.exception_handler(RequestValidationError)
    def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"error": "invalid request: " + "; ".join(msgs), "type": "BadRequest"}, status_code=422)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, reason = control.healthy()
        return JSONResponse({"ok": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ok, reason = control.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/status")
    def status() -> dict:
        return control.status()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/checkpoints")
    def checkpoints() -> dict:
        return {"checkpoints": control.list_checkpoints()}

    @app.post("/checkpoint", dependencies=[Depends(require_token)])
    def checkpoint() -> dict:
        return control.checkpoint()

    @app.post("/episode/start", dependencies=[Depends(require_token)])
    def episode_start(body: Optional[EpisodeStart] = None) -> dict:
        return control.start_episode(body or EpisodeStart())

    @app.post("/episode/stop", dependencies=[Depends(require_token)])
    def episode_stop() -> dict:
        return control.stop_episode()

    return app
