"""HTTP side of the teacher (FastAPI, served by uvicorn in the server's process).

``GET /healthz`` alive; ``GET /readyz`` 200 once the engine is loaded and warmed up, 503
before, while draining and once the engine is lost (in the server both are answered on
the HTTP thread, never by this app: :mod:`teacher_server.http_api.thread`); ``GET /metrics``
Prometheus text; ``GET /v1/info`` GetInfo as JSON (needs the bearer token when one is
configured).

With ``trl`` (:class:`~teacher_server.http_api.trl.TRLEndpoints`), the calls Hugging Face
TRL's teacher client makes: ``GET /health`` (200 once ready) and ``GET /v1/models``
(open: TRL's client reads them before it can send a token) and
``POST /get_sequence_logprobs/`` (TRL 1.10), which needs the bearer token when one is
configured (docs/trl.md).

With ``vllm`` (:class:`~teacher_server.http_api.vllm.serving.VLLMEndpoints`), vLLM's
``POST /v1/completions`` (TRL 1.11+, rllm, ms-swift) and ``POST /inference/v1/generate``
(Prime-RL), bearer token required when one is configured.

With ``sglang`` (:class:`~teacher_server.http_api.sglang.serving.SGLangEndpoints`),
SGLang's ``POST /generate`` as distillation frameworks call their teacher (slime, miles;
docs/frameworks.md), bearer token required when one is configured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from teacher_server.grpc_api.auth import token_matches
from teacher_server.http_api.answers import HTTPAnswer
from teacher_server.http_api.sglang.router import add_sglang_routes
from teacher_server.http_api.sglang.serving import SGLangEndpoints
from teacher_server.http_api.thread import probe_answer
from teacher_server.http_api.trl import TRLEndpoints
from teacher_server.http_api.vllm.router import add_vllm_routes
from teacher_server.http_api.vllm.serving import VLLMEndpoints
from teacher_server.lifecycle import Lifecycle, Phase
from teacher_server.metrics import TeacherMetrics
from topk_protocol import pb

__all__ = ["build_http_app"]


def build_http_app(
    *,
    lifecycle: Lifecycle,
    info: Callable[[], pb.TeacherInfo | None],
    metrics: TeacherMetrics,
    token: str | None = None,
    trl: TRLEndpoints | None = None,
    sglang: SGLangEndpoints | None = None,
    vllm: VLLMEndpoints | None = None,
) -> FastAPI:
    """The HTTP app; ``lifecycle`` and ``info()`` are read on every request.

    Handlers are ``async def``: they run on the serving loop. The server answers
    ``/healthz`` and ``/readyz`` before they reach this app (on the HTTP thread, same
    answers: :func:`~teacher_server.http_api.thread.probe_answer`); these routes serve the
    app on its own.
    """
    app = FastAPI(title="topk-distill teacher", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    @app.get("/readyz")
    async def probe(request: Request) -> Response:
        status, body = probe_answer(request.url.path, lifecycle, engine_alive=True)
        return Response(body, status_code=status, media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def authorized(request: Request) -> bool:
        return not token or token_matches(request.headers.get("authorization"), token)

    def unauthorized(request: Request) -> Response | None:
        if not authorized(request):
            return JSONResponse(
                {"error": "authorization: missing or wrong bearer token"}, status_code=401
            )
        return None

    @app.get("/v1/info")
    async def v1_info(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        msg = info()
        if msg is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        body: dict[str, Any] = MessageToDict(
            msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        return JSONResponse(body)

    if trl is not None:
        _add_trl_routes(app, trl, lifecycle, unauthorized)
    if sglang is not None:
        add_sglang_routes(app, sglang, authorized)
    if vllm is not None:
        add_vllm_routes(app, vllm, authorized)
    return app


def _json(answer: HTTPAnswer) -> Response:
    return Response(answer.body, status_code=answer.status, media_type="application/json")


def _add_trl_routes(
    app: FastAPI,
    trl: TRLEndpoints,
    lifecycle: Lifecycle,
    unauthorized: Callable[[Request], Response | None],
) -> None:
    """TRL's teacher calls (thin: the logic is in :mod:`teacher_server.http_api.trl`)."""

    @app.get("/health")
    @app.get("/health/")
    async def health() -> Response:
        ready = lifecycle.phase is Phase.READY
        return JSONResponse({"status": lifecycle.phase.value}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def v1_models() -> Response:
        return _json(trl.models())

    @app.post("/get_sequence_logprobs/")
    async def get_sequence_logprobs(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        return _json(await trl.sequence_logprobs(await request.body()))
