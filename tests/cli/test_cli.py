"""``kvtier`` CLI: flags override env, bad values exit 2 naming the flag or variable."""

from __future__ import annotations

import pytest

from kvtier.cli import SERVE_FLAGS, build_parser, main


def test_help_documents_every_flag_and_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in SERVE_FLAGS:
        assert flag in text
    assert "KVCACHED_OFFLOAD_LISTEN" in text and "KVCACHED_OFFLOAD_METRICS_ADDR" in text


def test_bad_flag_value_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and "KVCACHED_OFFLOAD_DEVICE" in err


def test_bad_env_value_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCACHED_OFFLOAD_GRACE_S", "soon")
    assert main(["serve"]) == 2
    assert "KVCACHED_OFFLOAD_GRACE_S" in capsys.readouterr().err


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.cli import _config

    monkeypatch.setenv("KVCACHED_OFFLOAD_DEVICE", "cuda:1")
    monkeypatch.setenv("KVCACHED_OFFLOAD_LISTEN", "unix:///a.sock,unix:///b.sock")
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    cfg = _config(args)
    assert cfg.device == "cpu" and cfg.listen == ("unix:///a.sock", "unix:///b.sock")

