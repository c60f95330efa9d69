"""The serving member's own route: ``POST /predict``. It reads the body up to the member's size
limit (a larger one is refused before it is read whole), parses the JSON, and hands it to the
role; what answered comes back in the ``X-Rpcps-Served`` header as well as the body."""
from __future__ import annotations

import json
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from services.errors import InvalidInput, RpcpsError, TooLarge
from services.sidecar import error_answers

SERVED_HEADER = "X-Rpcps-Served"


class ServedBy(BaseModel):
    """What answered: the model, and how old the newest update it reflects is."""

    source: str = Field(description="snapshot: an exported folder; online: the live servers")
    checkpoint: Optional[str] = Field(description="snapshot: the checkpoint the model was exported from")
    step: Optional[int] = Field(description="snapshot: its step; online: the updates ps0 had applied when the "
                                            "dense weights were read")
    updated_at: float = Field(description="snapshot: Unix time the checkpoint was taken; online: when the oldest "
                                          "row or weight the answer used was read from the servers")
    age_s: float = Field(description="seconds since then")


class Prediction(BaseModel):
    """The answer of POST /predict."""

    predictions: list[float] = Field(description="a click probability per row, in the rows' order")
    served: ServedBy


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the body holds {declared} bytes, at most {limit} (--body-bytes)")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise TooLarge(f"the body holds more than {limit} bytes (--body-bytes)")
    except ClientDisconnect:        # it went away, or was cut off for sending too slowly
        raise InvalidInput("the client closed the connection before the whole body came") from None
    return bytes(body)


def add_routes(app: FastAPI, control: Any) -> None:
    @app.post("/predict", response_model=Prediction, responses=error_answers(413, 422, 503))
    async def predict(request: Request) -> JSONResponse:
        """A click probability for each row of `{"rows": [{column: value, ...}, ...]}`, each row
        checked against the model's schema (a 422 names the row and column that do not fit)."""
        try:
            body = await _body(request, control.body_bytes)
            try:
                payload = json.loads(body)
            except (UnicodeDecodeError, ValueError) as exc:
                raise InvalidInput(f"the body is not JSON: {exc}") from None
            except RecursionError:
                raise InvalidInput("the body nests lists or objects deeper than JSON is read here") from None
        except RpcpsError as exc:
            control.refuse_body(exc)
            raise
        answer, served = await control.predict(payload)
        return JSONResponse(answer, headers={SERVED_HEADER: served})
