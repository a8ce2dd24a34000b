"""One server interceptor at the door of every call: drain gate, token check, RPC metrics, and
undecodable request bodies.

gRPC parses a request before any handler runs, and a body that is not the method's message would
end the call UNKNOWN with the parser's exception text. The wrapped deserializer turns it into a
:class:`Malformed` marker instead, and the call ends INVALID_ARGUMENT "request: malformed
<Message>" (after the drain and token checks) without touching the servicer.
Health calls pass untouched (probes must work while draining and without a token).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from .auth import HEALTH_PREFIX, TokenAuth

Observe = Callable[[str, str, float], None]  # (method, code name, seconds)


class Malformed:
    """Stands for a request body that did not parse as ``message`` (a message type name)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize`` answering :class:`Malformed` instead of raising on a bad body."""
    if deserialize is None:
        return None
    name = getattr(getattr(deserialize, "__self__", None), "__name__", "request")

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception:  # DecodeError, bad UTF-8 in a string field, ...: never the text
            return Malformed(name)

    return parse


class Gate(grpc.aio.ServerInterceptor):
    def __init__(self, auth: TokenAuth, draining: asyncio.Event, observe: Observe | None) -> None:
        self._auth = auth
        self._draining = draining
        self._observe = observe

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        return _wrap(handler, _Call(self, method.rsplit("/", 1)[-1], method))

    async def admit(self, method: str, ctx: Any) -> None:
        if self._draining.is_set():
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "daemon is draining; retry later")
        if not self._auth.allows(method, ctx.peer(), ctx.invocation_metadata() or ()):
            await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def parsed(self, req: Any, ctx: Any) -> None:
        if isinstance(req, Malformed):
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed {req.message}")

    def done(self, name: str, ctx: Any, start: float, failed: bool) -> None:
        if self._observe is None:
            return
        code = ctx.code() if failed else None
        if failed and code is None:
            code = grpc.StatusCode.UNKNOWN
        label = "OK" if code is None else code.name
        self._observe(name, label, time.perf_counter() - start)


class _Call:
    """Wraps one method's behaviour with admit/observe."""

    def __init__(self, gate: Gate, name: str, method: str) -> None:
        self.gate, self.name, self.method = gate, name, method

    async def unary(self, inner: Callable[..., Any], req: Any, ctx: Any) -> Any:
        start, failed = time.perf_counter(), True
        try:
            await self.gate.admit(self.method, ctx)
            await self.gate.parsed(req, ctx)
            result = await inner(req, ctx)
            failed = False
            return result
        finally:
            self.gate.done(self.name, ctx, start, failed)

    async def stream(self, inner: Callable[..., Any], req: Any, ctx: Any) -> AsyncIterator[Any]:
        start, failed = time.perf_counter(), True
        try:
            await self.gate.admit(self.method, ctx)
            await self.gate.parsed(req, ctx)
            out = inner(req, ctx)
            if hasattr(out, "__aiter__"):
                async for item in out:
                    yield item
            else:
                await out  # a coroutine that writes with ctx.write()
            failed = False
        finally:
            self.gate.done(self.name, ctx, start, failed)


def _wrap(h: grpc.RpcMethodHandler, call: _Call) -> grpc.RpcMethodHandler:
    """The same method with admit/observe around it; unary requests parse tolerantly."""
    raw = h.request_deserializer
    deserialize = raw if h.request_streaming else tolerant(raw)
    ser = {"request_deserializer": deserialize, "response_serializer": h.response_serializer}
    if h.unary_unary:
        inner_uu = h.unary_unary

        async def uu(req: Any, ctx: Any) -> Any:
            return await call.unary(inner_uu, req, ctx)

        return grpc.unary_unary_rpc_method_handler(uu, **ser)
    if h.stream_unary:
        inner_su = h.stream_unary

        async def su(req: Any, ctx: Any) -> Any:
            return await call.unary(inner_su, req, ctx)

        return grpc.stream_unary_rpc_method_handler(su, **ser)
    inner_st = h.unary_stream or h.stream_stream

    async def st(req: Any, ctx: Any) -> AsyncIterator[Any]:
        async for item in call.stream(inner_st, req, ctx):
            yield item

    if h.unary_stream:
        return grpc.unary_stream_rpc_method_handler(st, **ser)
    return grpc.stream_stream_rpc_method_handler(st, **ser)
