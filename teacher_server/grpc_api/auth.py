"""Shared bearer-token check on every gRPC call (``authorization: Bearer <token>``).

The standard health service stays open so that orchestrators can probe without the token,
and so does server reflection: it reveals only the schema (the same ``.proto`` that ships
with the client), never data, and lets ``grpcurl ... list`` work as documented.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

__all__ = ["OPEN_METHOD_PREFIXES", "BearerTokenInterceptor", "token_matches"]

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")


def token_matches(header: str | None, token: str) -> bool:
    """Constant-time check of an ``authorization`` header value against ``token``."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right bearer token with ``UNAUTHENTICATED``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("token: must be a non-empty string")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization")
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        if token_matches(header, self._token):
            return await continuation(handler_call_details)
        why = "authorization: missing bearer token" if not header else "authorization: wrong token"
        handler = await continuation(handler_call_details)
        return _denying_handler(handler, why)


_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _denying_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with UNAUTHENTICATED."""

    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(deny)
    factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
