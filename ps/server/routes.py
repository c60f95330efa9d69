"""A parameter server's own routes: ``POST /scale`` on the leader (the job onto N servers while it
trains) and ``POST /drain`` on any other server (its slots handed to the others, then it stops,
exit 0, as a Kubernetes ``preStop`` hook or an operator asks), each a call on the role's
``scaling`` (``ps/server/scaling.py``), behind the control token; ``GET /counts``, the updates in
its rows by slot, when it counts them (``--count-updates``)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from services.sidecar import error_answers, guarded

_ANSWERS = error_answers(400, 401, 409, 501, 503)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    servers: int = Field(ge=1, le=64, description="how many servers the job runs on: ps0 … ps<N-1>")


def add_routes(app: FastAPI, control: Any) -> None:
    @app.post("/scale", dependencies=guarded(app), responses=_ANSWERS)
    def scale(body: ScaleRequest) -> dict:
        """The leader: move the job onto `servers` servers while training goes on (each new one
        must be serving already, started beside the job); what moved, and how long the trainers
        were held."""
        return control.scaling.scale(body.servers)

    @app.post("/drain", dependencies=guarded(app), responses=_ANSWERS)
    def drain() -> dict:
        """A server other than the leader: hand its slots to the others, then stop (exit 0)."""
        return control.scaling.drain()

    @app.get("/counts", responses=error_answers(501, 503))
    def counts() -> dict:
        """Per table read by id, per slot of the layout, the updates this server's rows hold
        (`applied`, zeros for the slots others own), read at one instant; 501 unless every server
        was started with `--count-updates`."""
        return control.counts()
