"""``KVTierClient``: the blocking client. Same methods as ``AsyncKVTierClient``.

Every call has a deadline (``timeout``); failures raise ``kvtier.errors`` classes (see
``errors.py``). While the daemon is down calls raise ``Unavailable``; the channel reconnects by
itself. A pool of a previous daemon instance raises ``FailedPrecondition`` ("not attached (daemon
restarted?)"): call :meth:`reattach` to get a fresh pool (its old contents are gone).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import torch

from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

from . import ops
from .attachment import Attachment, from_reply
from .errors import Unavailable, from_rpc_error
from .fdpass import deposit_all, session_for
from .options import channel_options, metadata

CapacityShortfall = grpc.StatusCode.RESOURCE_EXHAUSTED


class KVTierClient:
    def __init__(self, address: str, tenant: str, token: str | None = None,
                 timeout: float = 5.0, *, tenant_token: str | None = None) -> None:
        self.address, self.tenant, self.timeout = address, tenant, timeout
        self._metadata = metadata(token, tenant_token)
        self._channel = grpc.insecure_channel(address, options=channel_options())
        self._stub = pb_grpc.KVTierStub(self._channel)
        self._session = session_for(address, timeout)  # holds this client's pools (leases)

    def __enter__(self) -> KVTierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the session too: the daemon detaches this client's pools after its lease grace."""
        self._channel.close()
        if self._session is not None:
            self._session.close()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the daemon accepts connections (e.g. after a restart), else Unavailable."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout or self.timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"daemon at {self.address} not reachable") from None

    def _ref(self, att: Attachment) -> pb.PoolRef:
        return pb.PoolRef(tenant=self.tenant, pool_id=att.pool_id, instance=att.instance)

    def _do(self, op: ops.Op) -> Any:
        try:
            reply = getattr(self._stub, op.method)(
                op.request, timeout=self.timeout + op.extra_timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if op.none_on_shortfall and err.code() == CapacityShortfall:
                return None
            raise from_rpc_error(err) from err
        return op.parse(reply)

    # --- pools ------------------------------------------------------------------------------
    def attach(self, num_pages: int | None = None, *, nbytes: int | None = None,
               page_size: int = 0, device: str = "", layout: str = "",
               default_priority: float = 1.0) -> Attachment:
        req = ops.attach_request(self.tenant, num_pages, nbytes, page_size, device, layout,
                                 default_priority)
        return from_reply(self._do(ops.Op("Attach", req)), self.tenant, req, register=False,
                          session=self._session, lane_timeout=self.timeout)

    def register(self, segments: Sequence[torch.Tensor], *, fds: Sequence[int] = (),
                 layout: str = "", default_priority: float = 1.0) -> Attachment:
        """Adopt engine-owned memory. CPU segments view sealed memfds (``ipc.SharedMemory``):
        ``fds`` gives each segment's descriptor; CUDA segments travel as IPC handles."""
        tickets = deposit_all(self._session, self.tenant, fds, len(segments))
        req = ops.register_request(self.tenant, segments, tickets, layout, default_priority)
        att = from_reply(self._do(ops.Op("Register", req)), self.tenant, req, register=True,
                         session=self._session, lane_timeout=self.timeout)
        att.keepalive.extend(segments)
        att.memfds.extend(fds)
        return att

    def reattach(self, att: Attachment) -> Attachment:
        """A new pool like ``att`` on the current daemon (after a restart); contents are gone."""
        req = att.request
        if not isinstance(req, pb.RegisterRequest):
            reply = self._do(ops.Op("Attach", req))
            return from_reply(reply, self.tenant, req, register=False, session=self._session,
                              lane_timeout=self.timeout)
        return self.register(att.keepalive, fds=att.memfds, layout=req.layout,
                             default_priority=req.default_priority)

    def detach(self, att: Attachment) -> None:
        self._do(ops.detach(self._ref(att)))
        if self._session is not None and att.lease:
            self._session.forget(att.lease)

    # --- pages ------------------------------------------------------------------------------
    def allocate(self, att: Attachment, n: int, *, priority: float | None = None,
                 sequence_length: int | None = None) -> list[tuple[int, int]] | None:
        return self._do(ops.allocate(self._ref(att), n, priority, sequence_length))

    def free(self, att: Attachment, page_ids: Sequence[int]) -> None:
        self._do(ops.pages("Free", self._ref(att), page_ids))

    def acquire(self, att: Attachment, page_ids: Sequence[int], *,
                timeout: float | None = None) -> list[int] | None:
        if att.fast_lane is not None and att.tenant == self.tenant:  # resident: without gRPC
            slots = att.fast_lane.acquire(att.pool_id, page_ids)
            if slots is not None:
                return slots
        return self._do(ops.acquire(self._ref(att), page_ids, timeout))

    def release(self, att: Attachment, page_ids: Sequence[int]) -> None:
        lane = att.fast_lane
        if lane is not None and att.tenant == self.tenant and lane.release(att.pool_id, page_ids):
            return
        self._do(ops.pages("Release", self._ref(att), page_ids))

    def offload(self, att: Attachment, page_ids: Sequence[int]) -> int:
        return int(self._do(ops.pages("Offload", self._ref(att), page_ids)))

    def prefetch(self, att: Attachment, page_ids: Sequence[int]) -> int:
        return int(self._do(ops.pages("Prefetch", self._ref(att), page_ids)))

    def page_tiers(self, att: Attachment, page_ids: Sequence[int]) -> list[Tier | None]:
        """Where each page is now (``None``: its bytes were dropped); a snapshot."""
        return self._do(ops.page_tiers(self._ref(att), page_ids))

    def set_priority(self, att: Attachment, page_ids: Sequence[int], priority: float) -> None:
        self._do(ops.set_priority(self._ref(att), page_ids, priority))

    # --- prefix reuse -----------------------------------------------------------------------
    def store(self, att: Attachment, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(self._do(ops.store(self._ref(att), keys, slots)))

    def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        return self._do(ops.lookup(self.tenant, keys))

    def load(self, att: Attachment, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        return int(self._do(ops.load(self._ref(att), keys, slots)))

    def load_layers(self, att: Attachment, keys: Sequence[bytes], slots: Sequence[int],
                    segment_bounds: Sequence[int]) -> Iterator[int]:
        """``load`` layer group by layer group (``LoadLayers``): group ``g`` is segments
        ``[segment_bounds[g], segment_bounds[g + 1])`` of the pool. Yields, per group once its
        bytes are in place, how many leading blocks it loaded (non-increasing); blocks past the
        last count yielded are not loaded (recompute them). The call starts now, not at the
        first ``next()``; closing the iterator early cancels it (the daemon releases all)."""
        req = ops.load_layers(self._ref(att), keys, slots, segment_bounds)
        stream = self._stub.LoadLayers(req, timeout=self.timeout, metadata=self._metadata)
        return self._counts(stream)

    @staticmethod
    def _counts(stream: Any) -> Iterator[int]:
        try:
            for reply in stream:
                yield int(reply.count)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        finally:
            stream.cancel()

    # --- operations -------------------------------------------------------------------------
    def stats(self, *, whole: bool = False) -> pb.StatsReply:
        """This tenant's own view; ``whole``: the daemon-wide view (with tenant credentials
        configured, only the admin token may see it)."""
        return self._do(ops.stats("" if whole else self.tenant))

    def watch_events(self, att: Attachment | None = None, *,
                     duration: float | None = None) -> Iterator[pb.Event]:
        """Events of this tenant's pools (or one pool) until the caller stops iterating or
        ``duration`` seconds pass (then the iterator simply ends)."""
        req = pb.WatchRequest(tenant=self.tenant, pool_id=att.pool_id if att else 0)
        stream = self._stub.WatchEvents(req, timeout=duration, metadata=self._metadata)
        return self._events(stream)  # the call starts now, not at the first next()

    @staticmethod
    def _events(stream: Any) -> Iterator[pb.Event]:
        try:
            yield from stream
        except grpc.RpcError as err:
            ended = grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
            if err.code() not in ended:
                raise from_rpc_error(err) from err
        finally:
            stream.cancel()


def connect(address: str | None = None, *, tenant: str, token: str | None = None,
            timeout: float = 5.0, tenant_token: str | None = None,
            tenant_token_file: str | None = None) -> KVTierClient:
    """A blocking client; ``address`` defaults to the daemon's default unix socket. ``token``:
    the TCP bearer token; ``tenant_token`` (or the first line of ``tenant_token_file``): the
    tenant's credential, sent with every call when the daemon checks tenants."""
    from .options import default_address, tenant_token_of

    secret = tenant_token_of(tenant_token, tenant_token_file)
    return KVTierClient(address or default_address(), tenant, token, timeout,
                        tenant_token=secret)
