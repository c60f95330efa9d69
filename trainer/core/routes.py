"""A trainer's own route: ``GET /counts``, the row updates of its acknowledged steps by slot, when
the servers count theirs (``rpcps ps --count-updates``, ``ps/spec/counting.py``); a call on the
role's control object."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from services.sidecar import error_answers


def add_routes(app: FastAPI, control: Any) -> None:
    @app.get("/counts", responses=error_answers(501, 503))
    def counts() -> dict:
        """Per table the servers count, per slot of the layout, the rows this trainer's steps read
        whose update every server acknowledged (`acked`), and those of steps that failed after
        their update was sent, which a server may have applied (`unsure`); 501 when the servers
        do not count."""
        return control.counts()
