"""Copy streams and events for the training primitives.

Every decision follows the devices of the tensors being copied, never ``torch.cuda.is_available()``:
a copy between CPU tensors is synchronous (``dst.copy_(src)``, no event, the result is ``None``)
even on a machine with a GPU; a copy touching a CUDA tensor runs on a side stream of that tensor's
device (one device->host and one host->device stream per device, created lazily), ordered after an
event recorded on that device's current (compute) stream, and returns a :class:`CopyDone` (the
completion event and its device). Callers hand those back through ``wait_on_compute``
(device-side ordering on the right device's current stream) or ``synchronize`` (host blocking).
"""

from __future__ import annotations

from typing import Any

import torch


class CopyDone:
    """Completion of one batch of side-stream copies: a CUDA event and the device it is on."""

    __slots__ = ("device", "event")

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event = event
        self.device = device

    def wait_on(self, stream: Any) -> None:
        stream.wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())


def cuda_device_of(*ts: torch.Tensor) -> torch.device | None:
    """The device of the first CUDA tensor among ``ts`` (None: every copy is host-only)."""
    for t in ts:
        if t.device.type == "cuda":
            return t.device
    return None


def _key(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class StreamPair:
    """Side streams for copies in both directions, ordered against the compute stream.

    ``d2h``/``h2d`` may be given streams; each is used for copies on its own device only."""

    def __init__(self, d2h: Any = None, h2d: Any = None) -> None:
        self._streams: dict[tuple[str, int], Any] = {}
        for which, s in (("d2h", d2h), ("h2d", h2d)):
            if s is not None:
                self._streams[(which, _key(s.device))] = s

    def _stream(self, which: str, device: torch.device) -> Any:
        key = (which, _key(device))
        s = self._streams.get(key)
        if s is None:
            s = torch.cuda.Stream(device=device)
            self._streams[key] = s
        return s

    def copy_many(self, which: str, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                  after: Any = None, *, record: bool = True,
                  after_compute: bool = True) -> CopyDone | None:
        """``dst.copy_(src)`` for each pair on the ``"d2h"`` or ``"h2d"`` stream, ordered after
        the compute stream's work so far (and ``after``: a :class:`CopyDone` or a list of them,
        ``None`` entries skipped); returns one completion (``None`` when no CUDA tensor is
        involved: the copies are then already done). ``record=False``: the caller keeps every
        device tensor alive until the completion is seen (or orders the compute stream after
        it) itself, so the allocator need not hold their memory until the side stream's later
        work is done as well. ``after_compute=False``: ordered after ``after`` only (a worker
        thread's copy whose hazards ``after`` already covers, issued while the compute stream
        runs work the copy must not wait for)."""
        device = cuda_device_of(*dsts, *srcs)
        if device is None:
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)
            return None
        stream = self._stream(which, device)
        if after_compute:
            stream.wait_event(torch.cuda.current_stream(device).record_event())
        for done in after if isinstance(after, list | tuple) else [after]:
            if done is not None:
                done.wait_on(stream)
        with torch.cuda.stream(stream):
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s, non_blocking=True)
                # the caching allocator must not give the device tensor back to the compute
                # stream before this side-stream copy is done
                for t in (d, s) if record else ():
                    if t.device.type == "cuda":
                        t.record_stream(stream)
            return CopyDone(stream.record_event(), device)

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None
                 ) -> CopyDone | None:
        """Start ``dst.copy_(src)`` on the D2H stream; returns its completion (or None)."""
        return self.copy_many("d2h", [dst], [src], after)

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None
                 ) -> CopyDone | None:
        """Start ``dst.copy_(src)`` on the H2D stream; returns its completion (or None)."""
        return self.copy_many("h2d", [dst], [src], after)

    @staticmethod
    def mark(device: torch.device) -> CopyDone | None:
        """An event on ``device``'s current stream (None for the CPU: nothing to wait for)."""
        if device.type != "cuda":
            return None
        return CopyDone(torch.cuda.current_stream(device).record_event(), device)

    @staticmethod
    def wait_on_compute(done: CopyDone | None) -> None:
        """Make the current stream of ``done``'s device wait for it (no host blocking)."""
        if done is not None:
            done.wait_on(torch.cuda.current_stream(done.device))

    @staticmethod
    def synchronize(*dones: CopyDone | None) -> None:
        """Block the host until every copy is done (host buffers may then be reused)."""
        for d in dones:
            if d is not None:
                d.synchronize()
