"""Tenant credentials: which caller may act as which tenant.

Without ``KVCACHED_OFFLOAD_TENANTS_FILE`` tenants are self-declared: whoever can open the socket
may name any tenant (the socket's permissions are the only boundary). With it, every call that
names a tenant (``tenant`` or ``pool.tenant``) must carry that tenant's token as metadata
``kvtier-tenant-token``:

    * no token, or a token of nobody: ``UNAUTHENTICATED``;
    * a valid token of another tenant (or the admin's): ``PERMISSION_DENIED``;
    * ``Stats`` with an empty tenant is the daemon-wide view: the admin token only.

Checked at the door (``interceptors.Gate``), before the call runs: a refused call changes
nothing. The fast lane needs no check of its own: its capabilities are handed out only in the
reply of an Attach that passed this one.

The file: one ``tenant token`` per line (whitespace-separated; ``#`` starts a comment), and
``@admin token`` for the admin credential. It must not be readable or writable by group or
others; it is read at start. ``reload()`` (the daemon calls it on SIGHUP) reads it again and
keeps the old entries, logging why, if the new file fails any check.

Tokens are kept and compared as SHA-256 digests: a presented token is hashed once, its holder
found by digest and confirmed with ``hmac.compare_digest`` (fixed length: the time taken says
nothing about a token's length or how much of it matched; one lookup whatever the number of
tenants).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Sequence
from typing import Any

from kvtier.config import ENV_PREFIX
from kvtier.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from kvtier.validate import check_name

log = logging.getLogger(__name__)
TOKEN_KEY = "kvtier-tenant-token"
ADMIN = "@admin"
VAR = ENV_PREFIX + "TENANTS_FILE"


class TenantCredentials:
    """Tenant (or ``ADMIN``) -> token; see the module docstring."""

    def __init__(self, tokens: dict[str, bytes], path: str = "") -> None:
        self._holders = _by_digest(tokens)
        self.path = path

    @classmethod
    def load(cls, path: str) -> TenantCredentials:
        """Read and check the file; ``ConfigError`` naming the variable on any problem."""
        return cls(_read(path), path)

    def reload(self) -> bool:
        """Read the file again; on any problem keep the current entries (and say why)."""
        try:
            tokens = _read(self.path)
        except ConfigError as exc:
            log.error("tenant credentials not reloaded, the old ones stay: %s", exc)
            return False
        self._holders = _by_digest(tokens)  # one reference swap: a call sees old or new
        log.info("tenant credentials reloaded from %s (%d entries)", self.path, len(tokens))
        return True

    def refuse(self, method: str, request: Any, metadata: Sequence[tuple[str, Any]]) -> \
            Unauthenticated | None:
        """Why the call may not run (``Unauthenticated`` or ``PermissionDenied``: the gRPC
        status is ``server/errors.py``'s), or ``None`` when it may."""
        tenant = _tenant_of(request)
        token = _token(metadata)
        if token is None:
            return Unauthenticated(f"missing tenant token (metadata {TOKEN_KEY})")
        who = self._holder(token)
        if who is None:
            return Unauthenticated("invalid tenant token")
        if method.endswith("/Stats") and who == ADMIN:
            return None  # the admin reads any view, and only that
        if method.endswith("/Stats") and not tenant:
            return PermissionDenied("the daemon-wide Stats view needs the admin credential")
        if who != tenant or who == ADMIN:  # the admin is no tenant, even one named "@admin"
            return PermissionDenied(f"the token is not valid for tenant {tenant[:128]!r}")
        return None

    def _holder(self, token: bytes) -> str | None:
        """Who holds ``token`` (see the module docstring), ``None``: nobody."""
        digest = hashlib.sha256(token).digest()
        entry = self._holders.get(digest)
        if entry is None or not hmac.compare_digest(digest, entry[1]):
            return None
        return entry[0]


def _by_digest(tokens: dict[str, bytes]) -> dict[bytes, tuple[str, bytes]]:
    """SHA-256 of each token -> (holder, that digest)."""
    out = {}
    for name, token in tokens.items():
        digest = hashlib.sha256(token).digest()
        out[digest] = (name, digest)
    return out


def _read(path: str) -> dict[str, bytes]:
    """The file's entries, after its checks; ``ConfigError`` naming the variable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO can't block
    except OSError as exc:
        raise ConfigError(f"{VAR}: cannot open {path!r}: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # (before fdopen, which refuses a directory with a traceback)
        os.close(fd)
        raise ConfigError(f"{VAR}: {path!r} is not a regular file")
    with os.fdopen(fd, encoding="utf-8") as fh:
        if mode & 0o077:
            raise ConfigError(
                f"{VAR}: {path!r} has mode {stat.S_IMODE(mode):04o}: group or others may "
                "access it; chmod 600 it"
            )
        try:
            text = fh.read()
        except (UnicodeDecodeError, OSError) as exc:
            raise ConfigError(f"{VAR}: cannot read {path!r}: {exc}") from None
    return _parse(text, path)


def _parse(text: str, path: str) -> dict[str, bytes]:
    tokens: dict[str, bytes] = {}
    seen: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].split()
        if not body:
            continue
        if len(body) != 2:
            raise ConfigError(f"{VAR}: {path!r} line {number}: expected 'tenant token'")
        name, token = body[0], body[1].encode()
        if name != ADMIN and not is_name(name):
            raise ConfigError(f"{VAR}: {path!r} line {number}: not a tenant name (letters, "
                              "digits and ._:@/-, starting with a letter or digit)")
        if name in tokens or token in seen:
            raise ConfigError(f"{VAR}: {path!r} line {number}: repeated tenant or token")
        tokens[name] = token
        seen.add(token)
    if not tokens:
        raise ConfigError(f"{VAR}: {path!r} lists no tenant")
    return tokens


def is_name(name: str) -> bool:
    """The engine's tenant-name rule: an entry that breaks it could never be used."""
    try:
        check_name("tenant", name)
    except InvalidArgument:
        return False
    return True


def _tenant_of(request: Any) -> str:
    """The tenant a request names (``pool.tenant`` or ``tenant``); "" if it names none (then
    only the admin may make it, and only a Stats call)."""
    descriptor = getattr(request, "DESCRIPTOR", None)
    fields = descriptor.fields_by_name if descriptor is not None else {}
    if "pool" in fields:
        return str(request.pool.tenant)
    if "tenant" in fields:
        return str(request.tenant)
    return ""


def _token(metadata: Sequence[tuple[str, Any]]) -> bytes | None:
    for key, value in metadata:
        if key == TOKEN_KEY:
            return value if isinstance(value, bytes) else str(value).encode()
    return None
