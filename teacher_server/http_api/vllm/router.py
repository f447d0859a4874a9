"""The FastAPI routes of vLLM's ``POST /v1/completions`` and ``POST /inference/v1/generate``
(thin: the logic is in :mod:`teacher_server.http_api.vllm.serving`)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request, Response

from teacher_server.http_api.answers import HTTPAnswer
from teacher_server.http_api.scoring import http_client
from teacher_server.http_api.vllm.serving import VLLMEndpoints, vllm_error

__all__ = ["add_vllm_routes"]

_DENIED = "authorization: missing or wrong bearer token"


def _response(answer: HTTPAnswer) -> Response:
    return Response(answer.body, status_code=answer.status, media_type="application/json")


def add_vllm_routes(
    app: FastAPI, vllm: VLLMEndpoints, authorized: Callable[[Request], bool]
) -> None:
    """Both routes on ``app``; ``authorized(request)``: the bearer token check."""

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        if not authorized(request):
            return _response(HTTPAnswer(401, b'{"error": "' + _DENIED.encode() + b'"}'))
        return _response(await vllm.completions(await request.body(), http_client(request)))

    @app.post("/inference/v1/generate")
    async def token_generate(request: Request) -> Response:
        if not authorized(request):
            return _response(vllm_error(401, _DENIED))
        return _response(await vllm.token_generate(await request.body(), http_client(request)))
