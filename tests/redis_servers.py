"""Real ``redis-server`` processes for tests: standalone or a three-node Cluster, on free
127.0.0.1 ports, in a temp dir, never persisting. Tests using them skip (with the reason) only
where ``redis-server`` is not installed; ``.ci/run`` installs it, so CI never skips."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server not installed (apt-get install redis-server; .ci/run installs it)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    dir: Path
    port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        assert REDIS_SERVER is not None
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--logfile", str(self.dir / f"redis-{self.port}.log"), *self.extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}: {self.log()}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on {self.port} not answering: {self.log()}")

    def log(self) -> str:
        path = self.dir / f"redis-{self.port}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH", b"-LOADING")) or b"NOPERM" in reply

    def cli(self, *args: str, user: str = "", password: str = "") -> str:
        assert REDIS_CLI is not None
        auth = ["--user", user, "--pass", password, "--no-auth-warning"] if user else []
        out = subprocess.run([REDIS_CLI, "-p", str(self.port), *auth, *args],
                             capture_output=True, timeout=30, check=True)
        return out.stdout.decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """The process stops answering (a store slower than any timeout) until ``resume``."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@dataclass
class RedisCluster:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start_cluster(tmp: Path, size: int = 3, timeout: float = 30.0) -> RedisCluster:
    """``size`` masters (no replicas) joined with ``redis-cli --cluster create``; a node gone
    leaves the other nodes serving their slots (``cluster-require-full-coverage no``)."""
    nodes: list[RedisServer] = []
    cluster = RedisCluster(nodes)
    try:
        for i in range(size):
            port = free_port()
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                     "--cluster-port", str(free_port()),
                     "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no")
            nodes.append(RedisServer(tmp / f"node{i}", port, extra))
            nodes[-1].start()
        nodes[0].cli("--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                     "--cluster-yes")
        # Ready when every node says so and knows every node and every slot (a node can say
        # ok before the others' slots have reached it; a client then finds slots uncovered).
        ready = ("cluster_state:ok", "cluster_slots_ok:16384", f"cluster_known_nodes:{size}")
        deadline = time.monotonic() + timeout
        while any(not all(r in n.cli("cluster", "info") for r in ready) for n in nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster did not reach cluster_state:ok on every node")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster
