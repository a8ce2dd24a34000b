"""``kvtier bench`` with an embedded daemon (CPU mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main


def test_bench_embedded_runs_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--seconds", "3", "--engines", "2", "--json", str(out_json)])
    out = capsys.readouterr()
    assert code == 0, out.err
    for word in ("hit rate", "p50 ms", "p99 ms", "restore", "resident", "GB/s", "Acquire"):
        assert word in out.out, out.out
    assert "0 byte mismatches" in out.out
    assert "3.0/3s" in out.err  # the progress bar finished
    data = json.loads(out_json.read_text())
    assert data["mismatches"] == 0 and data["errors"] == [] and data["verified_pages"] > 0
    assert data["samples"], "stats were sampled while running"


def test_bench_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    code = main(["bench", "--seconds", "1", "--engines", "1", "--pages-per-engine", "32",
                 "--plot", str(png)])
    assert code == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--seconds", "1", "--plot", "x.png"]) == 2
    assert "--plot" in capsys.readouterr().err


def test_bench_runs_as_one_tenant_with_its_credential(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    from kvtier_daemon_fixture import PAGE, daemon_env, start

    tenants = tmp_path / "tenants"
    tenants.write_text("load token-of-load\n")
    tenants.chmod(0o600)
    token = tmp_path / "token"
    token.write_text("token-of-load\n")
    d = start(tmp_path / "d", env=daemon_env(KVCACHED_OFFLOAD_TENANTS_FILE=str(tenants)))
    try:
        base = ["bench", "--address", d.address, "--seconds", "1", "--engines", "2",
                "--pages-per-engine", "32", "--page-size", str(PAGE)]
        assert main(base) == 1  # tenants bench-N have no credential: refused, said so
        assert "refused the credentials" in capsys.readouterr().err
        assert main([*base, "--tenant", "load", "--tenant-token-file", str(token)]) == 0
        out = capsys.readouterr().out
        assert "0 byte mismatches" in out and "Acquire" in out
        assert main([*base, "--tenant-token-file", str(token)]) == 2  # whose token?
        assert "--tenant-token-file" in capsys.readouterr().err
    finally:
        d.stop(signal.SIGKILL)


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "--seconds", "nan"], "--seconds: must be a finite number > 0"),
    (["bench", "--tenant", "bad name"], "--tenant: tenant: must be 1-128 characters"),
    (["status", "--tenant", "bad name"], "--tenant: tenant: must be 1-128 characters"),
    (["status", "--timeout", "inf"], "--timeout: must be a finite number > 0"),
])
def test_bad_values_are_one_line_and_exit_2(argv: list[str], says: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A bad tenant name was an uncaught InvalidArgument with a traceback; nan seconds ran."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "Traceback" not in "\n".join(err), err


def test_an_embedded_daemon_that_refuses_its_device_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--device bogus`` ended in a RuntimeError and a traceback."""
    assert main(["bench", "--seconds", "1", "--device", "bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the embedded daemon did not start (exit 2)" in err[0], err
    assert "KVCACHED_OFFLOAD_DEVICE" in err[0]
