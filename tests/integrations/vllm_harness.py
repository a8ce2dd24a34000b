"""Driving real vLLM engines (fresh processes) and real daemons for the connector's scenarios.

- :func:`run_engine` — one engine over phases of prompts; ``on_pause={i: fn}`` runs ``fn`` (a
  daemon restart, a disk corruption) after phase ``i`` while the engine waits. Each engine is a
  process of its own, forked from a server that imported vLLM once (``vllm_forkserver.py``);
  ``KVTIER_VLLM_FRESH=1`` starts ``python vllm_runner.py SPEC`` per engine instead.
- :func:`close_servers` — stop the fork servers (the session fixture calls it).
- :func:`reference` — the same prompts on vLLM without the connector, one phase per prompt.
- :class:`DaemonCtl` — one daemon on a fixed socket (so a running engine reconnects to it) that
  can be stopped (SIGTERM or kill -9) and started again on the same disk folder.
- :func:`mismatches` — prompts whose greedy tokens differ from the reference (must be none).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from integration_daemon import start_daemon, stop_daemon
from vllm_forkserver import Child, ForkServer, env_key

RUNNER = Path(__file__).with_name("vllm_runner.py")
ENGINE_TIMEOUT = 600
_SERVERS: dict[str, ForkServer] = {}  # one per engine environment, for the whole session


def _start(spec_file: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes] | Child:
    if os.environ.get("KVTIER_VLLM_FRESH") == "1":
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, str(RUNNER), str(spec_file)], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
    key = env_key(env)
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[key] = ForkServer(env, log.with_name(f"forkserver-{len(_SERVERS)}.log"))
    return server.start(spec_file, log, env)


def close_servers() -> None:
    """Stop every fork server (each also exits by itself when the test process goes)."""
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _env(spec: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    if spec.get("tp", 1) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(spec["tp"]))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _wait_for(path: Path, proc: subprocess.Popen[bytes] | Child, log: Path) -> None:
    deadline = time.monotonic() + ENGINE_TIMEOUT
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"engine exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"engine never reached {path.name}")
        time.sleep(0.2)


def run_engine(tmp: Path, name: str, model: Path, phases: list[list[Any]],
               kvtier: dict[str, Any] | None = None, *, block: int = 32, max_tokens: int = 8,
               on_pause: dict[int, Callable[[], None]] | None = None, **extra: Any
               ) -> list[list[int]]:
    """Greedy outputs of every prompt, in order; ``extra`` goes into the runner's spec."""
    spec: dict[str, Any] = {"model": str(model), "phases": phases, "max_tokens": max_tokens,
                            "block_size": block, "out": str(tmp / f"{name}.out.json"),
                            "kvtier": kvtier, **extra}
    pauses = on_pause or {}
    if pauses:
        sync = tmp / f"{name}.sync"
        sync.mkdir()
        spec.update(sync=str(sync), pause_after=sorted(pauses))
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    log = tmp / f"{name}.log"
    proc = _start(tmp / f"{name}.json", log, _env(spec))
    try:
        for i in sorted(pauses):
            _wait_for(sync / f"paused-{i}", proc, log)
            pauses[i]()
            (sync / f"resume-{i}").touch()
        rc = proc.wait(timeout=ENGINE_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert rc == 0, log.read_text()[-4000:]
    return json.loads((tmp / f"{name}.out.json").read_text())["outputs"]


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True)


def reference(tmp: Path, model: Path, prompts: list[Any], name: str = "ref", **extra: Any
              ) -> dict[str, list[int]]:
    """Outputs of vLLM without the connector, each prompt alone (prefix cache reset)."""
    uniq = list({_key(p): p for p in prompts}.values())
    outs = run_engine(tmp, name, model, [[p] for p in uniq], **extra)
    return {_key(p): o for p, o in zip(uniq, outs, strict=True)}


def mismatches(prompts: list[Any], got: list[list[int]], ref: dict[str, list[int]]
               ) -> list[int]:
    """Indices of prompts whose outputs differ from the reference."""
    assert len(got) == len(prompts)
    return [i for i, (p, o) in enumerate(zip(prompts, got, strict=True)) if ref[_key(p)] != o]


def stats(tmp: Path, name: str, rank: int = 0) -> dict[str, int]:
    suffix = f".rank{rank}" if rank else ""
    return json.loads((tmp / f"{name}.stats.json{suffix}").read_text())


def kv_config(address: str, tmp: Path, name: str, **kw: Any) -> dict[str, Any]:
    return {"address": address, "tenant": "it", "stats_file": str(tmp / f"{name}.stats.json"),
            **kw}


class DaemonCtl:
    """One daemon on ``sock`` (CPU device, optional disk); restartable in place."""

    def __init__(self, sock: Path, *, cpu_gb: float = 0.25, disk: Path | None = None) -> None:
        self.sock, self.cpu_gb, self.disk = sock, cpu_gb, disk
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        self.proc = start_daemon(self.sock, cpu_gb=self.cpu_gb, disk=self.disk)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if sig == signal.SIGTERM:
            stop_daemon(self.proc)
        else:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)
        self.proc = None
        self.sock.unlink(missing_ok=True)

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()
