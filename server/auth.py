"""Bearer-token check for TCP listeners.

gRPC exposes no peer credentials over a unix socket, so the unix socket is protected by file
permissions and calls arriving on it need no token. Any other peer (TCP) must send metadata
``authorization: Bearer <token>``. The health service's Check is exempt so orchestrator probes
work (its Watch, a stream a peer could hold open by the thousand, is not).

``bearer(metadata)``: whether the metadata carries the token (peer unknown: the interceptor asks
before any body is read, to admit a call with the token at once); ``tcp``: whether a token is
configured (without one the daemon has no TCP listener, so every call is a unix one).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_CHECK = HEALTH_PREFIX + "Check"


class TokenAuth:
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    @property
    def tcp(self) -> bool:
        return bool(self._token)

    def allows(self, method: str, peer: str, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        if method == HEALTH_CHECK or peer.startswith("unix:"):
            return True
        return self.bearer(metadata)

    def bearer(self, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        if not self._token:
            return False  # fail closed: a TCP call reached a daemon without a token
        for key, value in metadata:
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self._token
                )
        return False
