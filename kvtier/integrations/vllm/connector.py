"""kvtier as a vLLM v1 KV connector: prompts sharing a prefix load its KV instead of recomputing.

Load it with::

    kv_transfer_config={"kv_connector": "KVTierConnector",
                        "kv_connector_module_path": "kvtier.integrations.vllm.connector",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"address": "unix:///run/kvtier.sock",
                                                      "tenant": "team-a"}}

Extra config (:class:`ConnectorOptions`): ``address`` (required), ``tenant`` (``"default"``),
``token``, ``tenant_token_file`` (the tenant's credential, when the daemon checks tenants),
``timeout`` (s, 5), ``mode`` (``auto`` | ``register`` | ``copy``: register vLLM's CUDA KV
tensors with the daemon, or copy through a daemon staging pool; ``auto`` registers CUDA memory
and copies CPU memory), ``staging_slots`` (64), ``stats_file`` (write the worker's counters there
as JSON after every step that moved blocks and every store that ended), ``stores`` (``async``:
after the forward, off the step; ``sync``: in ``wait_for_save``, after a device synchronize),
``loads`` (``layer``: ``wait_for_layer_load`` waits per layer; ``block``: all in
``start_load_kv``), ``load_groups`` (``auto``, or 1..4096: registered loads in that many layer
groups, each group's layers ready when it lands; ``auto`` is 8 where an MPS control daemon is
running and 1 elsewhere: without MPS the daemon's copies do not run beside the forward, see
``groups``), ``store_wait_s`` (1.0: how long a
lookup waits for this engine's own store of the next block still in flight) and
``store_timeout_s`` (30: how long shutdown waits for stores in flight).

Scheduler side: the number of prompt tokens kvtier holds is the longest stored prefix of the
request's chained block keys that *every* tensor/pipeline rank holds, planned into loads and
stores by ``LoadStorePlanner``. Worker side (``WorkerSteps``): ``start_load_kv`` issues the
step's loads on a loader thread and ``wait_for_layer_load(layer)`` waits for that layer's copies
only (staging mode: the loader copies layer by layer; registered mode: the daemon's
``LoadLayers`` replies per ``load_groups`` group), so copies of later layers can overlap the
forward of earlier ones. ``wait_for_save``
records an event on the current stream and hands the step's full blocks to a store thread,
which stores them once the event has completed: no device synchronize and no store in the step.
A request with stores planned is finished with ``request_finished -> True`` (vLLM keeps its
blocks) and reported by ``get_finished`` once its stores have ended; a preemption
(``handle_preemptions``) waits for the stores in flight before vLLM reuses any block.

What identifies a cache entry (a page = one block across the rank's layers):

- the engine namespace: a fingerprint of the weights' files (names, sizes, mtimes, sampled
  content; a hub id is fingerprinted through its local snapshot), the model config, dtype, KV
  cache dtype, block size, the KV cache layout (per-rank heads, head size, dtype), tensor and
  pipeline sizes and the vLLM version — new weights at the same path never see old KV;
- the request's salt: LoRA adapter (name, path, files' fingerprint), ``cache_salt``, multimodal
  inputs — the same tokens under another adapter or image never share KV, whether vLLM's prefix
  caching is on (its block hashes, re-keyed) or off (chained hashes of the token ids);
- the tokens of the block and of every block before it (chained keys);
- the rank: each worker stores its shard under keys salted with its TP/PP rank and sizes; a
  prefix is a hit only for the blocks that every rank holds.
The daemon also salts every key per tenant.

Never wrong KV: a block that fails to load (rotten on disk, evicted meanwhile, daemon away) is
reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it (set
``kv_load_failure_policy="recompute"``; vLLM's default fails the request). In that step no block
whose chain meets a block that failed to load on any rank is stored (it was computed from
garbage); the blocks vLLM recomputes are stored in later steps.

When the daemon is away: vLLM starts without it (a warning, once), lookups are misses and stores
are skipped; after a restart (SIGTERM or kill -9) the worker re-attaches a fresh pool on the next
step in which the daemon answers (back-off 0.5 s doubling to 2 s) and stores resume. Logs go to
vLLM's logger tree (``vllm.kvtier.connector``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvtier.client.block_rows import BlockRows, block_segments

from .groups import MAX_GROUPS, auto_groups
from .identity import Rank, all_rank_keys, engine_namespace
from .link import DaemonLink
from .plan import BlockTransfer, LoadStorePlanner
from .steps import WorkerSteps
from .support import unsupported

if TYPE_CHECKING:
    import torch

log = init_logger("vllm.kvtier.connector")
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
    stores: str = "async"
    loads: str = "layer"
    load_groups: int | str = "auto"
    store_wait_s: float = 1.0
    store_timeout_s: float = 30.0

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
        for name, accepted in (("stores", ("async", "sync")), ("loads", ("layer", "block"))):
            if getattr(opts, name) not in accepted:
                raise ValueError(f"kv_connector_extra_config.{name}={getattr(opts, name)!r}; "
                                 f"accepted: {'|'.join(accepted)}")
        g = opts.load_groups
        if g != "auto" and (isinstance(g, bool) or not isinstance(g, int)
                            or not 1 <= g <= MAX_GROUPS):
            raise ValueError(f"kv_connector_extra_config.load_groups={g!r}; "
                             f"accepted: auto or an integer 1..{MAX_GROUPS}")
        for name in ("timeout", "store_wait_s", "store_timeout_s"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"kv_connector_extra_config.{name}={value!r}; "
                                 "accepted: a number of seconds >= 0")
        return opts


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, one step: blocks to load before the forward and store after it;
    requests whose blocks vLLM keeps until ``get_finished`` reports them; whether a request was
    preempted (its blocks may be reused: stores in flight must end first)."""

    loads: list[BlockTransfer]
    stores: list[BlockTransfer]
    delayed: list[str] = field(default_factory=list)
    flush: bool = False


def _engine_hashes_usable(cfg: Any) -> bool:
    cc = cfg.cache_config
    algo = getattr(cc, "prefix_caching_hash_algo", "")
    return bool(cc.enable_prefix_caching) and (
        algo in _REPRODUCIBLE_HASHES or "PYTHONHASHSEED" in os.environ)


def _rank(vllm_config: Any) -> Rank:
    """This worker's place in the shard layout (vLLM's groups exist before the connector)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    pc = vllm_config.parallel_config
    tp, pp = get_tp_group(), get_pp_group()
    return Rank(tp.rank_in_group, pc.tensor_parallel_size, pp.rank_in_group,
                pc.pipeline_parallel_size)


def _exchange(tainted: set[int]) -> set[int]:
    """The union of every rank's set (TP group, then PP group): a collective on all ranks."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    out = set(tainted)
    for group in (get_tp_group(), get_pp_group()):
        if group.world_size <= 1:
            continue
        parts: list[Any] = [None] * group.world_size
        dist.all_gather_object(parts, sorted(out), group=group.cpu_group)
        out = {b for part in parts for b in part}
    return out


class KVTierConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role (scheduler, each worker)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._opts = ConnectorOptions.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config))
        self._block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self._sizes = (pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._link = DaemonLink(self._connect, role.name.lower(), log)
        self._planner: LoadStorePlanner | None = None
        self._steps: WorkerSteps | None = None
        self._invalid: set[int] = set()
        self._delayed: set[str] = set()
        self._flushes = 0  # preemptions that waited for the stores in flight
        self._stats_lock = threading.Lock()
        self._rank = Rank()
        self._off = unsupported(kv_cache_config)
        if self._off is not None:
            log.warning("kvtier: the connector is off for this engine: %s (offloading its "
                        "blocks could serve wrong KV); vLLM runs without it", self._off)
        elif role == KVConnectorRole.SCHEDULER:
            self._planner = LoadStorePlanner(
                self._lookup, self._block_size, engine_namespace(vllm_config, kv_cache_config),
                use_engine_hashes=_engine_hashes_usable(vllm_config),
                async_stores=self._opts.stores == "async", store_wait_s=self._opts.store_wait_s)
        else:
            self._rank = _rank(vllm_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r; set 'recompute' so a failed load "
                        "is recomputed instead of failing the request",
                        self._kv_transfer_config.kv_load_failure_policy)

    # --- shared -----------------------------------------------------------------------------
    def _connect(self) -> Any:
        from kvtier.client.sync import connect

        o = self._opts
        return connect(o.address, tenant=o.tenant, token=o.token or None, timeout=o.timeout,
                       tenant_token_file=o.tenant_token_file or None)

    def _lookup(self, keys: list[bytes]) -> int | None:
        """Leading blocks of ``keys`` that every rank holds; ``None`` while the daemon is away."""
        if not self._link.ready():
            return None
        tp, pp = self._sizes
        try:
            found = len(self._link.client().lookup(all_rank_keys(keys, tp, pp)))
        except Exception as exc:  # a daemon outage is a miss, never a failed request
            self._link.failed(exc)
            return None
        self._link.ok()
        return found // (tp * pp)

    def shutdown(self) -> None:
        if self._steps is not None:
            self._steps.close()  # waits (bounded) for the stores in flight
            self._write_stats()
        self._link.close()

    # --- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if self._planner is None:  # off (``support.unsupported``)
            return 0, False
        return self._planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._planner is None:
            return
        self._planner.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._planner is None:
            return KVTierConnectorMetadata(loads=[], stores=[], delayed=[], flush=False)
        so = scheduler_output
        loads, stores = self._planner.build(so.scheduled_new_reqs, so.scheduled_cached_reqs,
                                            so.num_scheduled_tokens,
                                            so.scheduled_spec_decode_tokens)
        return KVTierConnectorMetadata(loads=loads, stores=stores,
                                       delayed=self._planner.take_delayed(),
                                       flush=bool(getattr(so, "preempted_req_ids", None)))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``True`` (keep the blocks until ``get_finished``) when stores were planned for it."""
        if self._planner is None:
            return False, None
        return self._planner.finished(request.request_id), None

    # --- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._off is not None:
            return  # no worker steps: every step hook finds nothing to do
        tensors = list(kv_caches.values())
        num_blocks = self._num_blocks(tensors)
        rows = BlockRows([s for t in tensors for s in block_segments(t, num_blocks)])
        register = self._opts.mode == "register" or (
            self._opts.mode == "auto" and tensors[0].is_cuda)
        world = self._rank.world
        layers, first = {}, 0
        for name, t in kv_caches.items():
            n = len(block_segments(t, num_blocks))
            layers[name], first = range(first, first + n), first + n
        o = self._opts
        self._steps = WorkerSteps(self._link, rows, log, rank=self._rank, register=register,
                                  staging_slots=o.staging_slots,
                                  exchange=_exchange if world > 1 else None, layers=layers,
                                  async_stores=o.stores == "async",
                                  layer_loads=o.loads == "layer",
                                  load_groups=self._load_groups(),
                                  store_timeout_s=o.store_timeout_s,
                                  on_stored=self._write_stats if o.stats_file else None)
        self._steps.mover()  # attach now if the daemon is up; else on a later step
        log.info("kvtier: %d layers, %d blocks of %d bytes (tenant %s, rank %d of %d)",
                 len(tensors), num_blocks, rows.page_bytes, self._opts.tenant,
                 self._rank.tp_rank + self._rank.tp_size * self._rank.pp_rank, world)

    def _load_groups(self) -> int:
        """``load_groups``, with ``auto`` worked out here (``groups.auto_groups``: 8 layer groups
        under MPS, else 1), and said once."""
        g = self._opts.load_groups
        if g == "auto":
            g = auto_groups()
            log.info("kvtier: registered loads in %d layer group(s) (%s)", g,
                     "MPS is running" if g > 1 else "no MPS: the daemon's copies are "
                     "time-sliced against the forward")
        assert isinstance(g, int)
        return g

    def _num_blocks(self, tensors: list[torch.Tensor]) -> int:
        cfg = self._kv_cache_config
        if cfg is not None and getattr(cfg, "num_blocks", None):
            return int(cfg.num_blocks)
        return int(tensors[0].shape[0])

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before vLLM reuses a preempted request's blocks: no store may still read them."""
        if self._steps is not None and getattr(kv_connector_metadata, "flush", False):
            self._steps.flush_stores()
            self._flushes += 1

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierConnectorMetadata) or self._steps is None:
            return
        self._delayed.update(meta.delayed)
        self._steps.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._steps is not None:
            self._steps.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole pages (all layers) are stored after the forward, from wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierConnectorMetadata) or self._steps is None:
            return
        self._steps.end(meta.stores)
        if meta.loads or meta.stores:
            self._write_stats()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Delayed requests whose stores have all ended (each reported once)."""
        if self._steps is None:
            return None, None
        delayed, self._delayed = self._delayed, set()
        return self._steps.finished(delayed) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._steps is not None:
            self._steps.join_loads()
            self._invalid |= self._steps.take_invalid()
        out, self._invalid = self._invalid, set()
        return out

    def _write_stats(self) -> None:
        if not self._opts.stats_file or self._steps is None:
            return
        data = dict(self._steps.counters.as_dict(), block_size=self._block_size,
                    outages=self._link.outages, preemption_flushes=self._flushes)
        path = self._opts.stats_file
        r = self._rank
        if r.world > 1 and (r.tp_rank or r.pp_rank):
            path = f"{path}.rank{r.tp_rank + r.tp_size * r.pp_rank}"
        with self._stats_lock:  # the store thread writes too
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
            os.replace(tmp, path)
