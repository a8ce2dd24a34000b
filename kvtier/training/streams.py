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

    def _copy(self, which: str, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        device = self._cuda_of(dst, src)
        if device is None:
            dst.copy_(src)
            return None
        stream = self._stream(which, device)
        ready = torch.cuda.current_stream(device).record_event()
        stream.wait_event(ready)
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not hand the device tensor to the compute stream again
            # before this side-stream copy is done
            for t in (dst, src):
                if t.device.type == "cuda":
                    t.record_stream(stream)
            return stream.record_event()

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Start ``dst.copy_(src)`` on the D2H stream; returns its completion event (or None)."""
        return self._copy("_d2h", dst, src, after)

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Start ``dst.copy_(src)`` on the H2D stream; returns its completion event (or None)."""
        return self._copy("_h2d", dst, src, after)

    @staticmethod
    def wait_on_compute(event: Any) -> None:
        """Make the current stream wait for ``event`` (no host blocking)."""
        if event is not None:
            torch.cuda.current_stream(event.device if hasattr(event, "device") else None
                                      ).wait_event(event)

    @staticmethod
    def synchronize(*events: Any) -> None:
        """Block the host until every event is done (host buffers may then be reused)."""
        for e in events:
            if e is not None:
                e.synchronize()
