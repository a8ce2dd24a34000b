"""Engines in forked processes of one server that imported vLLM once.

Importing vLLM and torch takes most of a fresh engine process's time (~35 of ~45 s on 2 cores);
the engine itself starts in ~5 s. The server imports vLLM in exactly the environment a fresh
runner process would get, then forks one child per engine spec, before any engine, thread or
connection exists. Each child is still a fresh process for the scenario: its own pid, engine,
connector, daemon connections and exit, so daemon restarts between or during engines behave as
with ``python vllm_runner.py SPEC``.

- :class:`ForkServer` — the server process (one per distinct environment), ``start(spec, log)``
  -> :class:`Child`; it exits when its stdin closes.
- :class:`Child` — ``poll``/``wait``/``kill`` of one forked engine, like ``subprocess.Popen``.

Protocol: the client writes one JSON line ``{"spec", "log", "pid", "rc"}`` (paths) and ``env``
(the child's environment: the server's, but for variables such as ``PYTEST_CURRENT_TEST`` that
vLLM never reads and that change from test to test); the server forks, writes the child's pid to
``pid`` and, once it exits, its return code (negative: killed by that signal) to ``rc`` (both
written to a temporary name, then renamed).

``python vllm_forkserver.py`` runs the server loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _child(spec: str, log: str, env: dict[str, str]) -> None:
    """In the forked child: ``env``, output to ``log``, run the spec, exit as a fresh runner
    would."""
    import random
    import traceback

    import vllm_runner

    os.environ.clear()
    os.environ.update(env)
    random.seed()  # a fresh process draws its own seed; forked children would share one
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    code = 0
    try:
        vllm_runner.main(spec)
    except BaseException:  # the log must show why, as the runner's own traceback would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A normal interpreter exit: atexit handlers and finalizers shut the engine (and its
    # tensor-parallel workers) down as they do at the end of a fresh runner process.
    raise SystemExit(code)


def serve() -> None:
    """Import vLLM, then fork one child per request line until stdin closes."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm  # noqa: F401  (the import this server exists to pay once)
    import vllm_runner  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.lora.request import LoRARequest  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req["spec"], req["log"], req["env"])
        _write(Path(req["pid"]), str(pid))
        _, status = os.waitpid(pid, 0)
        _write(Path(req["rc"]), str(os.waitstatus_to_exitcode(status)))


class Child:
    """One forked engine; ``returncode`` as ``subprocess.Popen`` gives it."""

    def __init__(self, server: ForkServer, pid_file: Path, rc_file: Path) -> None:
        self.server, self.pid_file, self.rc_file = server, pid_file, rc_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_file.exists():
            self.returncode = int(self.rc_file.read_text())
        if self.returncode is None and self.server.proc.poll() is not None:
            self.returncode = -999  # the server died: so did (or will) its child
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("forked engine", timeout)
            time.sleep(0.1)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        deadline = time.monotonic() + 60
        while not self.pid_file.exists() and self.poll() is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(self.pid_file.read_text()), signal.SIGKILL)


VOLATILE = ("PYTEST_CURRENT_TEST",)  # set per test by pytest; no part of an engine's setup


def env_key(env: dict[str, str]) -> str:
    """Engines whose environments have the same key can share one server."""
    return json.dumps({k: v for k, v in env.items() if k not in VOLATILE}, sort_keys=True)


class ForkServer:
    """A server process importing vLLM under ``env``; engines run one at a time."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self._out = open(log, "wb")  # noqa: SIM115  (open for the server's lifetime)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__))], env=env, cwd=HERE,
                                     stdin=subprocess.PIPE, stdout=self._out,
                                     stderr=subprocess.STDOUT)

    def start(self, spec: Path, log: Path, env: dict[str, str]) -> Child:
        """Fork an engine for ``spec`` under ``env`` with its output in ``log``."""
        pid, rc = log.with_suffix(".pid"), log.with_suffix(".rc")
        req: dict[str, Any] = {"spec": str(spec), "log": str(log), "pid": str(pid), "rc": str(rc),
                               "env": env}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return Child(self, pid, rc)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    serve()
