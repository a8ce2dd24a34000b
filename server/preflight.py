"""Start-up checks of ``kvtier serve`` against the machine, before anything is built or bound.

``prepare(config, addrs) -> locks`` runs, in this order:
  1. the device exists (``--device cuda`` on a machine where torch sees no GPU);
  2. the disk directory is a writable directory of a real filesystem (not a file, not under
     /proc or /sys, not read-only: a probe file is written and removed) whose entries under the
     disk tier's file names it can use (regular files, no links, each openable as the tier
     needs: ``kvtier.tiers.disk_layout.unusable_file``) and nothing of anyone else's where none
     is the tier's (``foreign_entry``); a budget beyond its filesystem is then warned about (a
     line on stderr, not a refusal: the tier's file grows as pages come); the tenants file
     (when set) is private
     and well formed — before the engine spends time starting;
  3. every unix socket's directory exists or can be created, and the path fits a socket address;
  4. the instance locks (``pidlock``): one per unix socket, one in the disk directory;
  5. no program answers on a socket already at a unix path (a stale one is replaced);
  6. the metrics port and every TCP listener can be bound.
Each failure is a :class:`ConfigError` "<flag>/<VARIABLE>: <problem>" on one line (the CLI
prints it and exits 2); nothing live (a socket, a port) has been touched when one is raised.
Locks come before ports so that a second start names the running daemon's pid rather than
failing on its metrics port.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
from typing import NoReturn

from kvtier.config import ENV_PREFIX, OffloadConfig
from kvtier.config_rules import disk_size_warning
from kvtier.errors import ConfigError
from kvtier.flags import setting
from kvtier.tiers.disk_layout import LOCK_NAME, foreign_entry, unusable_file

from .app import socket_dir
from .credentials import TenantCredentials
from .pidlock import PidLock, hold

PSEUDO_FILESYSTEMS = ("/proc", "/sys")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def fail(name: str, problem: str) -> NoReturn:
    raise ConfigError(f"{setting(name)}: {problem}")


def prepare(config: OffloadConfig, addrs: list[str]) -> list[PidLock]:
    """Every check above; returns the locks, to hold until the daemon exits."""
    check_device(config)
    check_disk(config)
    check_tenants(config)
    unix = [a[len("unix://"):] for a in addrs if a.startswith("unix://")]
    for path in unix:
        check_socket_dir(path)
    locks = take_locks(config, unix)
    try:
        for path in unix:
            check_socket_free(path)
        check_ports(config, [a for a in addrs if not a.startswith("unix://")])
    except ConfigError:
        for lock in locks:
            lock.release()
        raise
    return locks


def check_device(config: OffloadConfig) -> None:
    device = config.resolved_device()
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        built = "with" if torch.version.cuda else "without"
        fail("device", f"{config.device!r} needs a CUDA GPU, and torch {torch.__version__} "
                       f"(built {built} CUDA) sees none; use --device cpu")
    n = torch.cuda.device_count()
    for name in config.resolved_devices():  # every GPU of a list, not only the first
        if int(name.partition(":")[2] or 0) >= n:
            fail("device", f"{config.device!r}: torch sees {n} CUDA device(s)")


def check_disk(config: OffloadConfig) -> None:
    """The disk directory, created if missing, takes a file; only when the disk tier is on."""
    if not config.disk_budget_bytes:
        return
    path = config.disk_path
    real = os.path.realpath(path)
    for pseudo in PSEUDO_FILESYSTEMS:
        if real == pseudo or real.startswith(pseudo + "/"):
            fail("disk_path", f"{path} is under {pseudo}, not a disk")
    if os.path.lexists(real) and not os.path.isdir(real):
        fail("disk_path", f"{path} exists and is not a directory")
    try:
        os.makedirs(real, mode=0o700, exist_ok=True)  # private whatever the umask
        fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=real)
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        fail("disk_path", f"{path} is not a writable directory: {exc.strerror}")
    foreign = foreign_entry(path)
    if foreign is not None:  # someone else's directory (``/``, a home): never taken over
        fail("disk_path", foreign)
    problem = unusable_file(real)
    if problem is not None:  # the operator's to fix: never deleted, never followed
        fail("disk_path", problem)
    beyond = disk_size_warning(config, ENV_PREFIX)
    if beyond is not None:  # a usable directory, but a budget its filesystem can't hold
        print(f"kvtier serve: warning: {beyond}", file=sys.stderr)


def check_tenants(config: OffloadConfig) -> None:
    """The tenants file passes every check the daemon applies when it loads it."""
    if config.tenants_file:
        TenantCredentials.load(config.tenants_file)  # ConfigError naming the variable


def check_socket_dir(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        fail("listen", f"unix://{path}: a socket path is at most {MAX_SOCKET_PATH} bytes")
    try:
        directory = socket_dir(path)
    except ConfigError as exc:
        fail("listen", str(exc))
    except OSError as exc:
        fail("listen", f"unix://{path}: cannot create its directory: {exc.strerror}")
    if not os.access(directory, os.W_OK | os.X_OK):
        fail("listen", f"unix://{path}: directory {directory} is not writable")
    if os.path.lexists(path) and not _is_socket(path):
        fail("listen", f"unix://{path} exists and is not a socket")


def check_socket_free(path: str) -> None:
    """A socket already at ``path`` is replaced only if nothing answers on it (a stale one):
    with our lock held, one that answers is another program's, never taken from it."""
    if not _is_socket(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return  # stale: nobody listens
    fail("listen", f"unix://{path}: another program is serving on it")


def take_locks(config: OffloadConfig, unix: list[str]) -> list[PidLock]:
    locks: list[PidLock] = []
    try:
        for path in unix:
            locks.append(hold(path + ".lock", setting("listen"), f"unix://{path}"))
        if config.disk_budget_bytes:
            lock = os.path.join(os.path.realpath(config.disk_path), LOCK_NAME)
            locks.append(hold(lock, setting("disk_path"), config.disk_path))
    except ConfigError:
        for held in locks:
            held.release()
        raise
    return locks


def check_ports(config: OffloadConfig, tcp: list[str]) -> None:
    if config.metrics_addr:
        problem = bind_problem(config.metrics_addr)
        if problem:
            fail("metrics_addr", problem)
    for addr in tcp:
        problem = bind_problem(addr)
        if problem:
            fail("listen", problem)


def bind_problem(addr: str) -> str | None:
    """Why ``host:port`` can't be bound now, or None (the probe socket is closed at once)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        info = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM,
                                  flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, ValueError) as exc:
        return f"cannot resolve {addr}: {exc}"
    with socket.socket(info[0], info[1], info[2]) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(info[4])
        except OSError as exc:
            return f"cannot bind {addr}: {exc.strerror}"
    return None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
