"""The FastAPI route of SGLang's ``POST /generate`` (thin: the logic is in
:mod:`teacher_server.http_api.sglang.serving`)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request, Response

from teacher_server.http_api.scoring import http_client
from teacher_server.http_api.sglang.serving import SGLangEndpoints, sglang_error

__all__ = ["add_sglang_routes"]


def add_sglang_routes(
    app: FastAPI, sglang: SGLangEndpoints, authorized: Callable[[Request], bool]
) -> None:
    """``POST /generate`` on ``app``; ``authorized(request)``: the bearer token check."""

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        if not authorized(request):
            answer = sglang_error(401, "authorization: missing or wrong bearer token")
        else:
            answer = await sglang.generate(await request.body(), http_client(request))
        return Response(answer.body, status_code=answer.status, media_type="application/json")
