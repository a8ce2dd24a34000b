"""Copy streams and events for the training primitives.

``StreamPair`` owns one device->host and one host->device stream (created lazily, on the device of
the first tensor copied). Every copy is ordered after an event recorded on the caller's (compute)
stream and returns an event recorded after it; without CUDA every copy is synchronous and the
returned event is ``None``. Callers hand events back through ``wait_on_compute``/``synchronize``.
"""

from __future__ import annotations

from typing import Any

import torch


class StreamPair:
    """Side streams for copies in both directions, ordered against the compute stream."""

    def __init__(self, d2h: Any = None, h2d: Any = None) -> None:
        self._d2h = d2h
        self._h2d = h2d

    @staticmethod
    def _cuda_of(*ts: torch.Tensor) -> torch.device | None:
        for t in ts:
            if t.device.type == "cuda":
                return t.device
        return None

    def _stream(self, which: str, device: torch.device) -> Any:
        s = getattr(self, which)
        if s is None:
            s = torch.cuda.Stream(device=device)
            setattr(self, which, s)
        return s

    def copy_many(self, which: str, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                  after: Any = None) -> Any:
        """``dst.copy_(src)`` for each pair on the ``"d2h"`` or ``"h2d"`` stream, ordered after
        the compute stream's work so far (and ``after``: an event or a list of events, ``None``
        entries skipped); returns one completion event."""
        device = self._cuda_of(*dsts, *srcs)
        if device is None:
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)
            return None
        stream = self._stream("_" + which, device)
        stream.wait_event(torch.cuda.current_stream(device).record_event())
        for event in after if isinstance(after, list | tuple) else [after]:
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s, non_blocking=True)
                # the caching allocator must not give the device tensor back to the compute
                # stream before this side-stream copy is done
                for t in (d, s):
                    if t.device.type == "cuda":
                        t.record_stream(stream)
            return stream.record_event()

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Start ``dst.copy_(src)`` on the D2H stream; returns its completion event (or None)."""
        return self.copy_many("d2h", [dst], [src], after)

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Start ``dst.copy_(src)`` on the H2D stream; returns its completion event (or None)."""
        return self.copy_many("h2d", [dst], [src], after)

    @staticmethod
    def wait_on_compute(event: Any) -> None:
        """Make the current stream wait for ``event`` (no host blocking)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    @staticmethod
    def synchronize(*events: Any) -> None:
        """Block the host until every event is done (host buffers may then be reused)."""
        for e in events:
            if e is not None:
                e.synchronize()
