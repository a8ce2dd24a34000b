"""``AsyncKVTierClient``: the asyncio client; the same methods as ``KVTierClient``, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import torch

from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

from . import ops
from .attachment import Attachment, from_reply
from .errors import Unavailable, from_rpc_error
from .fastlane import ACQUIRE, RELEASE, AsyncFastLane
from .fdpass import deposit_all, session_for
from .options import channel_options, default_address, metadata, tenant_token_of


class AsyncKVTierClient:
    def __init__(self, address: str, tenant: str, token: str | None = None,
                 timeout: float = 5.0, *, tenant_token: str | None = None) -> None:
        self.address, self.tenant, self.timeout = address, tenant, timeout
        self._metadata = metadata(token, tenant_token)
        self._channel = grpc.aio.insecure_channel(address, options=channel_options())
        self._stub = pb_grpc.KVTierStub(self._channel)
        self._lanes: dict[str, AsyncFastLane] = {}  # one per daemon socket
        self._session = session_for(address, timeout)  # holds this client's pools (leases)

    async def __aenter__(self) -> AsyncKVTierClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for lane in self._lanes.values():
            await lane.close()
        await self._channel.close()
        if self._session is not None:  # the daemon detaches our pools after its lease grace
            self._session.close()

    async def _fast(self, att: Attachment, op: int, page_ids: Sequence[int]) -> list[int] | None:
        """The fast lane's answer for resident pages, or ``None`` (then the caller uses gRPC)."""
        sync_lane = att.fast_lane
        if sync_lane is None or att.tenant != self.tenant:
            return None
        frame = sync_lane.frame(op, att.pool_id, page_ids)
        if frame is None:
            return None
        lane = self._lanes.get(sync_lane.path)
        if lane is None:
            lane = self._lanes[sync_lane.path] = AsyncFastLane(sync_lane.path, self.timeout)
        return await lane.call(frame)

    def _attached(self, att: Attachment) -> Attachment:
        """A new pool on a lane's socket: a lane that failed is tried again at once (a daemon
        restarted, then ``reattach``), not only after its backoff."""
        lane = self._lanes.get(att.fast_lane.path) if att.fast_lane is not None else None
        if lane is not None:
            lane.backoff.reset()
        return att

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the daemon accepts connections (e.g. after a restart), else Unavailable."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout or self.timeout)
        except TimeoutError:
            raise Unavailable(f"daemon at {self.address} not reachable") from None

    def _ref(self, att: Attachment) -> pb.PoolRef:
        return pb.PoolRef(tenant=self.tenant, pool_id=att.pool_id, instance=att.instance)

    async def _do(self, op: ops.Op) -> Any:
        try:
            reply = await getattr(self._stub, op.method)(
                op.request, timeout=self.timeout + op.extra_timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if op.none_on_shortfall and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None
            raise from_rpc_error(err) from err
        return op.parse(reply)

    async def attach(self, num_pages: int | None = None, *, nbytes: int | None = None,
                     page_size: int = 0, device: str = "", layout: str = "",
                     default_priority: float = 1.0) -> Attachment:
        req = ops.attach_request(self.tenant, num_pages, nbytes, page_size, device, layout,
                                 default_priority)
        reply = await self._do(ops.Op("Attach", req))
        return self._attached(await asyncio.to_thread(
            from_reply, reply, self.tenant, req, register=False, session=self._session))

    async def register(self, segments: Sequence[torch.Tensor], *, fds: Sequence[int] = (),
                       layout: str = "", default_priority: float = 1.0) -> Attachment:
        """As ``KVTierClient.register``: ``fds`` are the sealed memfds of CPU segments."""
        tickets = await asyncio.to_thread(deposit_all, self._session, self.tenant, fds,
                                          len(segments))
        req = ops.register_request(self.tenant, segments, tickets, layout, default_priority)
        reply = await self._do(ops.Op("Register", req))
        att = await asyncio.to_thread(from_reply, reply, self.tenant, req, register=True,
                                      session=self._session)
        att.keepalive.extend(segments)
        att.memfds.extend(fds)
        return self._attached(att)

    async def reattach(self, att: Attachment) -> Attachment:
        req = att.request
        if not isinstance(req, pb.RegisterRequest):
            reply = await self._do(ops.Op("Attach", req))
            return self._attached(await asyncio.to_thread(
                from_reply, reply, self.tenant, req, register=False, session=self._session))
        return await self.register(att.keepalive, fds=att.memfds, layout=req.layout,
                                   default_priority=req.default_priority)

    async def detach(self, att: Attachment) -> None:
        await self._do(ops.detach(self._ref(att)))
        if self._session is not None and att.lease:
            self._session.forget(att.lease)

    async def allocate(self, att: Attachment, n: int, *, priority: float | None = None,
                       sequence_length: int | None = None) -> list[tuple[int, int]] | None:
        return await self._do(ops.allocate(self._ref(att), n, priority, sequence_length))

    async def free(self, att: Attachment, page_ids: Sequence[int]) -> None:
        await self._do(ops.pages("Free", self._ref(att), page_ids))

    async def acquire(self, att: Attachment, page_ids: Sequence[int], *,
                      timeout: float | None = None) -> list[int] | None:
        slots = await self._fast(att, ACQUIRE, page_ids)  # resident pages: without gRPC
        if slots is not None:
            return slots
        return await self._do(ops.acquire(self._ref(att), page_ids, timeout))

    async def release(self, att: Attachment, page_ids: Sequence[int]) -> None:
        if await self._fast(att, RELEASE, page_ids) is not None:
            return
        await self._do(ops.pages("Release", self._ref(att), page_ids))

    def lane_hits(self) -> int:
        """Calls the fast lane answered (for tests and benchmarks)."""
        return sum(lane.hits for lane in self._lanes.values())

    async def offload(self, att: Attachment, page_ids: Sequence[int]) -> int:
        return int(await self._do(ops.pages("Offload", self._ref(att), page_ids)))

    async def prefetch(self, att: Attachment, page_ids: Sequence[int]) -> int:
        return int(await self._do(ops.pages("Prefetch", self._ref(att), page_ids)))

    async def page_tiers(self, att: Attachment, page_ids: Sequence[int]) -> list[Tier | None]:
        """Where each page is now (``None``: its bytes were dropped); a snapshot."""
        return await self._do(ops.page_tiers(self._ref(att), page_ids))

    async def set_priority(self, att: Attachment, page_ids: Sequence[int],
                           priority: float) -> None:
        await self._do(ops.set_priority(self._ref(att), page_ids, priority))

    async def store(self, att: Attachment, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(await self._do(ops.store(self._ref(att), keys, slots)))

    async def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        return await self._do(ops.lookup(self.tenant, keys))

    async def load(self, att: Attachment, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(await self._do(ops.load(self._ref(att), keys, slots)))

    async def load_layers(self, att: Attachment, keys: Sequence[bytes], slots: Sequence[int],
                          segment_bounds: Sequence[int]) -> AsyncIterator[int]:
        """As ``KVTierClient.load_layers``; the call starts at the first iteration."""
        req = ops.load_layers(self._ref(att), keys, slots, segment_bounds)
        call = self._stub.LoadLayers(req, timeout=self.timeout, metadata=self._metadata)
        try:
            async for reply in call:
                yield int(reply.count)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        finally:
            call.cancel()

    async def stats(self, *, whole: bool = False) -> pb.StatsReply:
        """This tenant's own view; ``whole``: the daemon-wide view (with tenant credentials
        configured, only the admin token may see it)."""
        return await self._do(ops.stats("" if whole else self.tenant))

    async def watch_events(self, att: Attachment | None = None, *,
                           duration: float | None = None) -> AsyncIterator[pb.Event]:
        req = pb.WatchRequest(tenant=self.tenant, pool_id=att.pool_id if att else 0)
        call = self._stub.WatchEvents(req, timeout=duration, metadata=self._metadata)
        try:
            async for ev in call:
                yield ev
        except grpc.RpcError as err:
            ended = grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
            if err.code() not in ended:
                raise from_rpc_error(err) from err
        finally:
            call.cancel()


def connect_async(address: str | None = None, *, tenant: str, token: str | None = None,
                  timeout: float = 5.0, tenant_token: str | None = None,
                  tenant_token_file: str | None = None) -> AsyncKVTierClient:
    """As ``connect``: ``tenant_token`` (or the first line of ``tenant_token_file``) is the
    tenant's credential, sent with every call when the daemon checks tenants."""
    secret = tenant_token_of(tenant_token, tenant_token_file)
    return AsyncKVTierClient(address or default_address(), tenant, token, timeout,
                             tenant_token=secret)
