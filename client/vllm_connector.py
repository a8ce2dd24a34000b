"""kvtier as a vLLM v1 KV connector: prompts sharing a prefix load its KV instead of recomputing.

Load it with::

    kv_transfer_config={"kv_connector": "KVTierConnector",
                        "kv_connector_module_path": "kvtier.client.vllm_connector",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"address": "unix:///run/kvtier.sock",
                                                      "tenant": "team-a"}}

Extra config (:class:`ConnectorOptions`): ``address`` (required), ``tenant`` (``"default"``),
``token``, ``tenant_token_file`` (the tenant's credential, when the daemon checks tenants),
``timeout`` (s, 5), ``mode`` (``auto`` | ``register`` | ``copy``: register vLLM's CUDA KV
tensors with the daemon, or copy through a daemon staging pool; ``auto`` registers CUDA memory
and copies CPU memory), ``staging_slots`` (64), ``stats_file`` (write the worker's counters there
as JSON after every step that moved blocks).

Scheduler side: the number of prompt tokens kvtier holds is the longest stored prefix of the
request's chained block keys (vLLM's own block hashes where they are reproducible; kvtier salts
them per tenant), planned into loads and stores by ``LoadStorePlanner``. Worker side: loads run
synchronously in ``start_load_kv`` before the forward; full blocks are stored in ``wait_for_save``
after it. A block that fails to load is reported through ``get_block_ids_with_load_errors`` so
vLLM recomputes it (set ``kv_load_failure_policy="recompute"``; vLLM's default fails the request):
a load yields the stored bytes or a recompute, never wrong KV. Stores are best effort.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from ._backend import Backend, ClientBackend
from ._blocks import namespace
from ._vllm_pages import BlockRows, block_segments
from ._vllm_sched import BlockTransfer, LoadStorePlanner
from ._vllm_worker import BlockMover

if TYPE_CHECKING:
    import torch

log = init_logger("kvtier.client.vllm_connector")
_REPRODUCIBLE_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True, kw_only=True, slots=True)
class ConnectorOptions:
    """``kv_connector_extra_config``, validated once."""

    address: str
    tenant: str = "default"
    token: str = ""
    tenant_token_file: str = ""
    timeout: float = 5.0
    mode: str = "auto"
    staging_slots: int = 64
    stats_file: str = ""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown}; known {sorted(known)}")
        if not extra.get("address"):
            raise ValueError(
                "kv_connector_extra_config.address is required (unix:///... or host:port)")
        opts = cls(**extra)
        if opts.mode not in ("auto", "register", "copy"):
            raise ValueError(
                f"kv_connector_extra_config.mode={opts.mode!r}; accepted: auto|register|copy")
        if opts.staging_slots <= 0:
            raise ValueError("kv_connector_extra_config.staging_slots must be positive")
        return opts


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, one step: blocks to load before the forward and store after it."""

    loads: list[BlockTransfer]
    stores: list[BlockTransfer]


def _namespace(cfg: Any) -> bytes:
    """What a page's bytes depend on besides the tokens: model, dtypes, shapes, block size, TP."""
    mc, pc, cc = cfg.model_config, cfg.parallel_config, cfg.cache_config
    return namespace("vllm", mc.model, str(mc.dtype), cc.cache_dtype, cc.block_size,
                     mc.get_num_layers(pc), mc.get_total_num_kv_heads(), mc.get_head_size(),
                     pc.tensor_parallel_size, pc.pipeline_parallel_size)


def _engine_hashes_usable(cfg: Any) -> bool:
    cc = cfg.cache_config
    algo = getattr(cc, "prefix_caching_hash_algo", "")
    return bool(cc.enable_prefix_caching) and (
        algo in _REPRODUCIBLE_HASHES or "PYTHONHASHSEED" in os.environ)


class KVTierConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role (scheduler, each worker)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._opts = ConnectorOptions.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config))
        self._backend: Backend | None = None
        self._block_size = vllm_config.cache_config.block_size
        self._planner: LoadStorePlanner | None = None
        self._mover: BlockMover | None = None
        self._invalid: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._planner = LoadStorePlanner(
                self._lookup, self._block_size, _namespace(vllm_config),
                use_engine_hashes=_engine_hashes_usable(vllm_config))
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r; set 'recompute' so a failed load "
                        "is recomputed instead of failing the request",
                        self._kv_transfer_config.kv_load_failure_policy)

    # --- shared -----------------------------------------------------------------------------
    def _client(self) -> Backend:
        if self._backend is None:
            from .sync import connect

            o = self._opts
            client = connect(o.address, tenant=o.tenant, token=o.token or None, timeout=o.timeout,
                             tenant_token_file=o.tenant_token_file or None)
            self._backend = ClientBackend(client)
        return self._backend

    def _lookup(self, keys: list[bytes]) -> int:
        try:
            return len(self._client().lookup(keys))
        except Exception as exc:  # a daemon outage is a miss, never a failed request
            log.warning("kvtier: lookup failed (%s); treating as a miss", exc)
            return 0

    def shutdown(self) -> None:
        if self._mover is not None:
            try:
                self._mover.close()
            except Exception as exc:
                log.warning("kvtier: detach failed: %s", exc)
        if isinstance(self._backend, ClientBackend):
            self._backend.client.close()

    # --- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._planner is not None
        return self._planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._planner is not None
        so = scheduler_output
        loads, stores = self._planner.build(so.scheduled_new_reqs, so.scheduled_cached_reqs,
                                            so.num_scheduled_tokens,
                                            so.scheduled_spec_decode_tokens)
        return KVTierConnectorMetadata(loads=loads, stores=stores)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self._planner is not None:
            self._planner.finished(request.request_id)
        return False, None

    # --- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        num_blocks = self._num_blocks(tensors)
        segments = [s for t in tensors for s in block_segments(t, num_blocks)]
        rows = BlockRows(segments)
        register = self._opts.mode == "register" or (
            self._opts.mode == "auto" and tensors[0].is_cuda)
        self._mover = BlockMover(self._client(), rows, register=register,
                                 staging_slots=self._opts.staging_slots)
        log.info("kvtier: %s %d layers, %d blocks of %d bytes (tenant %s)",
                 "registered" if register else "copying through staging for", len(tensors),
                 num_blocks, rows.page_bytes, self._opts.tenant)

    def _num_blocks(self, tensors: list[torch.Tensor]) -> int:
        cfg = self._kv_cache_config
        if cfg is not None and getattr(cfg, "num_blocks", None):
            return int(cfg.num_blocks)
        return int(tensors[0].shape[0])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierConnectorMetadata) or self._mover is None:
            return
        for t in meta.loads:
            try:
                got = self._mover.load(t)
            except Exception as exc:
                log.warning("kvtier: load for %s failed (%s); recomputing", t.req_id, exc)
                got = 0
            if got < len(t.block_ids):
                self._invalid.update(t.block_ids[got:])
            log.info("kvtier: loaded %d of %d blocks (%d tokens) for %s", got, len(t.keys),
                     got * self._block_size, t.req_id)
        if meta.loads:
            self._write_stats()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole pages (all layers) are stored after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierConnectorMetadata) or self._mover is None:
            return
        for t in meta.stores:
            try:
                self._mover.store(t)
            except Exception as exc:
                log.warning("kvtier: store for %s failed (%s); it will be recomputed later",
                            t.req_id, exc)
        if meta.stores:
            self._write_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def _write_stats(self) -> None:
        if not self._opts.stats_file or self._mover is None:
            return
        data = dict(self._mover.counters.as_dict(), block_size=self._block_size)
        tmp = f"{self._opts.stats_file}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, self._opts.stats_file)
