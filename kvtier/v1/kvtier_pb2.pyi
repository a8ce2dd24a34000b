from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandleKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDLE_KIND_UNSPECIFIED: _ClassVar[HandleKind]
    HANDLE_KIND_CUDA_IPC: _ClassVar[HandleKind]
    HANDLE_KIND_SHM: _ClassVar[HandleKind]
    HANDLE_KIND_MEMFD: _ClassVar[HandleKind]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
HANDLE_KIND_UNSPECIFIED: HandleKind
HANDLE_KIND_CUDA_IPC: HandleKind
HANDLE_KIND_SHM: HandleKind
HANDLE_KIND_MEMFD: HandleKind
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolRef(_message.Message):
    __slots__ = ("tenant", "pool_id", "instance")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    pool_id: int
    instance: str
    def __init__(self, tenant: _Optional[str] = ..., pool_id: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("kind", "device", "ipc")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    kind: HandleKind
    device: str
    ipc: bytes
    def __init__(self, kind: _Optional[_Union[HandleKind, str]] = ..., device: _Optional[str] = ..., ipc: _Optional[bytes] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("tenant", "device", "page_size", "num_pages", "bytes", "layout", "default_priority")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    device: str
    page_size: int
    num_pages: int
    bytes: int
    layout: str
    default_priority: float
    def __init__(self, tenant: _Optional[str] = ..., device: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., bytes: _Optional[int] = ..., layout: _Optional[str] = ..., default_priority: _Optional[float] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("pool_id", "page_size", "num_slots", "handle", "instance", "fast_lane", "lease")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    FAST_LANE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    page_size: int
    num_slots: int
    handle: PoolHandle
    instance: str
    fast_lane: FastLane
    lease: Lease
    def __init__(self, pool_id: _Optional[int] = ..., page_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., handle: _Optional[_Union[PoolHandle, _Mapping]] = ..., instance: _Optional[str] = ..., fast_lane: _Optional[_Union[FastLane, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("path", "ticket")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    path: str
    ticket: bytes
    def __init__(self, path: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class FastLane(_message.Message):
    __slots__ = ("path", "capability")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    path: str
    capability: bytes
    def __init__(self, path: _Optional[str] = ..., capability: _Optional[bytes] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("ipc", "memfd_ticket", "num_slots", "slot_stride", "slot_bytes", "offset")
    IPC_FIELD_NUMBER: _ClassVar[int]
    MEMFD_TICKET_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ipc: bytes
    memfd_ticket: bytes
    num_slots: int
    slot_stride: int
    slot_bytes: int
    offset: int
    def __init__(self, ipc: _Optional[bytes] = ..., memfd_ticket: _Optional[bytes] = ..., num_slots: _Optional[int] = ..., slot_stride: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("tenant", "segments", "layout", "default_priority")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    layout: str
    default_priority: float
    def __init__(self, tenant: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., layout: _Optional[str] = ..., default_priority: _Optional[float] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ...) -> None: ...

class DetachReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("pool", "count", "priority", "sequence_length")
    POOL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    count: int
    priority: float
    sequence_length: int
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., count: _Optional[int] = ..., priority: _Optional[float] = ..., sequence_length: _Optional[int] = ...) -> None: ...

class PageSlot(_message.Message):
    __slots__ = ("page_id", "slot")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    slot: int
    def __init__(self, page_id: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[PageSlot]
    def __init__(self, pages: _Optional[_Iterable[_Union[PageSlot, _Mapping]]] = ...) -> None: ...

class PagesRequest(_message.Message):
    __slots__ = ("pool", "page_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("pool", "page_ids", "timeout_s")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class CountReply(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class PageTiersReply(_message.Message):
    __slots__ = ("tiers", "lost")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lost: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lost: _Optional[_Iterable[bool]] = ...) -> None: ...

class SetPriorityRequest(_message.Message):
    __slots__ = ("pool", "page_ids", "priority")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: float
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[float] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("pool", "keys", "slots")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tenant", "keys")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("pool", "keys", "slots")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadLayersRequest(_message.Message):
    __slots__ = ("pool", "keys", "slots", "segment_bounds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedScalarFieldContainer[int]
    segment_bounds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[int]] = ..., segment_bounds: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadLayersReply(_message.Message):
    __slots__ = ("group", "count")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    group: int
    count: int
    def __init__(self, group: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "pages")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    pages: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

class DirectionStats(_message.Message):
    __slots__ = ("direction", "bytes", "pages", "batches", "seconds", "failures", "bytes_per_s", "latency_s")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    direction: str
    bytes: int
    pages: int
    batches: int
    seconds: float
    failures: int
    bytes_per_s: float
    latency_s: float
    def __init__(self, direction: _Optional[str] = ..., bytes: _Optional[int] = ..., pages: _Optional[int] = ..., batches: _Optional[int] = ..., seconds: _Optional[float] = ..., failures: _Optional[int] = ..., bytes_per_s: _Optional[float] = ..., latency_s: _Optional[float] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tiers", "pools", "tenants", "queued_restores", "queued_offloads", "inflight_bytes", "pinned_pages", "keyed_pages", "moved", "evictions", "drops", "hits", "misses", "checksum_failures", "version", "instance", "remote")
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DropsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_RESTORES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    KEYED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    pools: int
    tenants: int
    queued_restores: int
    queued_offloads: int
    inflight_bytes: int
    pinned_pages: int
    keyed_pages: int
    moved: _containers.RepeatedCompositeFieldContainer[DirectionStats]
    evictions: _containers.ScalarMap[str, int]
    drops: _containers.ScalarMap[str, int]
    hits: _containers.ScalarMap[str, int]
    misses: int
    checksum_failures: int
    version: str
    instance: str
    remote: RemoteStats
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., pools: _Optional[int] = ..., tenants: _Optional[int] = ..., queued_restores: _Optional[int] = ..., queued_offloads: _Optional[int] = ..., inflight_bytes: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., keyed_pages: _Optional[int] = ..., moved: _Optional[_Iterable[_Union[DirectionStats, _Mapping]]] = ..., evictions: _Optional[_Mapping[str, int]] = ..., drops: _Optional[_Mapping[str, int]] = ..., hits: _Optional[_Mapping[str, int]] = ..., misses: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., version: _Optional[str] = ..., instance: _Optional[str] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("reachable", "written_pages", "written_bytes", "read_pages", "read_bytes", "queued_bytes", "dropped", "rejected", "errors")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_PAGES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    written_pages: int
    written_bytes: int
    read_pages: int
    read_bytes: int
    queued_bytes: int
    dropped: _containers.ScalarMap[str, int]
    rejected: _containers.ScalarMap[str, int]
    errors: _containers.ScalarMap[str, int]
    def __init__(self, reachable: _Optional[bool] = ..., written_pages: _Optional[int] = ..., written_bytes: _Optional[int] = ..., read_pages: _Optional[int] = ..., read_bytes: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ..., rejected: _Optional[_Mapping[str, int]] = ..., errors: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("tenant", "pool_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    pool_id: int
    def __init__(self, tenant: _Optional[str] = ..., pool_id: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "pool_id", "page_id", "src", "dst")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    kind: str
    pool_id: int
    page_id: int
    src: Tier
    dst: Tier
    def __init__(self, kind: _Optional[str] = ..., pool_id: _Optional[int] = ..., page_id: _Optional[int] = ..., src: _Optional[_Union[Tier, str]] = ..., dst: _Optional[_Union[Tier, str]] = ...) -> None: ...
