"""Static checks of the image recipe (building it needs a registry this CI cannot reach)."""

from __future__ import annotations

from deploy_helpers import ROOT

DOCKERFILE = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()


def test_base_torch_and_install() -> None:
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in DOCKERFILE
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in DOCKERFILE
    assert "RUN pip install . " in DOCKERFILE


def test_runs_kvtier_serve_as_non_root() -> None:
    lines = [line.strip() for line in DOCKERFILE.splitlines()]
    users = [line for line in lines if line.startswith("USER ")]
    assert users and users[-1] == "USER 1000:1000"
    assert 'ENTRYPOINT ["kvtier"]' in lines and 'CMD ["serve"]' in lines


def test_build_context_keeps_what_pip_install_needs() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = {"pyproject.toml", "README.md", "kvtier", "server", "client"}
    assert not copied & ignored
    assert ".git" in ignored
