"""One server interceptor at the door of every call: drain gate, token check, RPC metrics,
undecodable request bodies, and tenant credentials (``credentials.py``, when configured).

gRPC parses a request before any handler runs, and a body that is not the method's message would
end the call UNKNOWN with the parser's exception text. The wrapped deserializer turns it into a
:class:`Malformed` marker instead, and the call ends INVALID_ARGUMENT "request: malformed
<Message>" (after the drain and token checks) without touching the servicer.

A call without the token on a daemon with a TCP listener is admitted before its body is read:
its unary request is taken as a stream (raw bytes, read only once the peer is known to be a
unix one, or the call refused), so a peer without the token can't make the daemon receive and
parse bodies up to the message limit (tens of MiB each, many at once). Health Check passes
without the checks (probes work while draining and without a token) but parses tolerantly;
Health Watch needs the token on TCP. Health calls are not counted in the RPC metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from .auth import HEALTH_CHECK, HEALTH_PREFIX, TokenAuth
from .credentials import TenantCredentials
from .errors import status_for
from .turns import Turns

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
    def __init__(self, auth: TokenAuth, draining: asyncio.Event, observe: Observe | None,
                 tenants: TenantCredentials | None = None, turns: Turns | None = None) -> None:
        self._auth = auth
        self._draining = draining
        self._observe = observe
        self._tenants = tenants
        self._turns = turns

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None:
            return handler
        health = method.startswith(HEALTH_PREFIX)
        call = _Call(self, "" if health else method.rsplit("/", 1)[-1], method,
                     checked=method != HEALTH_CHECK)
        unread = call.checked and self._auth.tcp and not self._auth.bearer(
            details.invocation_metadata or ())
        return _wrap(handler, call, unread=unread)

    async def admit(self, method: str, ctx: Any) -> None:
        if self._draining.is_set():
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "daemon is draining; retry later")
        if not self._auth.allows(method, ctx.peer(), ctx.invocation_metadata() or ()):
            await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def parsed(self, req: Any, ctx: Any) -> None:
        if isinstance(req, Malformed):
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed {req.message}")

    async def credentials(self, method: str, ctx: Any, req: Any) -> None:
        """With a tenants file: the call's tenant token must be the named tenant's (health
        calls name no tenant)."""
        if self._tenants is not None and not method.startswith(HEALTH_PREFIX):
            refused = self._tenants.refuse(method, req, ctx.invocation_metadata() or ())
            if refused is not None:
                await ctx.abort(*status_for(refused))

    def turn(self, method: str, req: Any) -> contextlib.AbstractAsyncContextManager[None]:
        """The call's turn among its tenant's (``turns.py``); a WatchEvents stream, long and
        idle, and a call naming no tenant take none."""
        tenant = getattr(req, "tenant", "") or getattr(getattr(req, "pool", None), "tenant", "")
        if self._turns is None or not tenant or method.endswith("/WatchEvents"):
            return contextlib.nullcontext()
        return self._turns.turn(tenant)

    def done(self, name: str, ctx: Any, start: float, failed: bool) -> None:
        if self._observe is None or not name:
            return
        code = ctx.code() if failed else None
        if failed and code is None:
            code = grpc.StatusCode.UNKNOWN
        label = "OK" if code is None else code.name
        self._observe(name, label, time.perf_counter() - start)


class _Call:
    """Wraps one method's behaviour with admit/observe."""

    def __init__(self, gate: Gate, name: str, method: str, *, checked: bool = True) -> None:
        self.gate, self.name, self.method, self.checked = gate, name, method, checked

    async def _admitted(self, req: Any, ctx: Any) -> Any:
        """The drain and token checks (unless exempt), then the request: read now if unread."""
        if self.checked:
            await self.gate.admit(self.method, ctx)
        if isinstance(req, _Unread):
            req = await req.read()
        await self.gate.parsed(req, ctx)
        return req

    async def unary(self, inner: Callable[..., Any], req: Any, ctx: Any) -> Any:
        start, failed = time.perf_counter(), True
        try:
            req = await self._admitted(req, ctx)
            await self.gate.credentials(self.method, ctx, req)
            async with self.gate.turn(self.method, req):
                result = await inner(req, ctx)
            failed = False
            return result
        finally:
            self.gate.done(self.name, ctx, start, failed)

    async def stream(self, inner: Callable[..., Any], req: Any, ctx: Any) -> AsyncIterator[Any]:
        start, failed = time.perf_counter(), True
        try:
            req = await self._admitted(req, ctx)
            await self.gate.credentials(self.method, ctx, req)
            async with self.gate.turn(self.method, req):
                out = inner(req, ctx)
                if hasattr(out, "__aiter__"):
                    async for item in out:
                        yield item
                else:
                    await out  # a coroutine that writes with ctx.write()
            failed = False
        finally:
            self.gate.done(self.name, ctx, start, failed)


class _Unread:
    """A unary request not read yet: the call's request stream (raw bytes) and its parser."""

    __slots__ = ("_parse", "_requests")

    def __init__(self, requests: AsyncIterator[bytes], parse: Callable[[bytes], Any]) -> None:
        self._requests, self._parse = requests, parse

    async def read(self) -> Any:
        async for raw in self._requests:
            return self._parse(raw)
        return Malformed("request")  # no body at all


def _wrap(h: grpc.RpcMethodHandler, call: _Call, *, unread: bool = False) -> grpc.RpcMethodHandler:
    """The same method with admit/observe around it; unary requests parse tolerantly, and with
    ``unread`` are taken as a stream of raw bytes, read only once admitted."""
    raw = h.request_deserializer
    deserialize = raw if h.request_streaming else tolerant(raw)
    ser = {"request_deserializer": deserialize, "response_serializer": h.response_serializer}
    if unread and not h.request_streaming:
        parse = deserialize or (lambda b: b)
        lazy = {"request_deserializer": None, "response_serializer": h.response_serializer}
        inner_u = h.unary_unary or h.unary_stream
        if h.unary_unary:

            async def lazy_uu(requests: Any, ctx: Any) -> Any:
                return await call.unary(inner_u, _Unread(requests, parse), ctx)

            return grpc.stream_unary_rpc_method_handler(lazy_uu, **lazy)

        async def lazy_us(requests: Any, ctx: Any) -> AsyncIterator[Any]:
            async for item in call.stream(inner_u, _Unread(requests, parse), ctx):
                yield item

        return grpc.stream_stream_rpc_method_handler(lazy_us, **lazy)
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
