"""Bearer-token check for TCP listeners.

gRPC exposes no peer credentials over a unix socket, so the unix socket is protected by file
permissions and calls arriving on it need no token. Any other peer (TCP) must send metadata
``authorization: Bearer <token>``. The health service is exempt so orchestrator probes work.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenAuth:
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def allows(self, method: str, peer: str, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        if method.startswith(HEALTH_PREFIX) or peer.startswith("unix:"):
            return True
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
