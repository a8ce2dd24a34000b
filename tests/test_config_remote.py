"""The remote tier's settings: parsed from the environment, bad values named."""

from __future__ import annotations

import pytest

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError

P = "KVCACHED_OFFLOAD_"


def test_remote_settings_from_env():
    c = OffloadConfig.from_env({
        P + "REMOTE_URL": "rediss://kvtier@valkey.example:6380/0",
        P + "REMOTE_SECRET_FILE": "/etc/kvtier/remote/secret",
        P + "REMOTE_PASSWORD_FILE": "/etc/kvtier/remote/password",
        P + "REMOTE_TTL_S": "600",
        P + "REMOTE_ADMISSION": "reused",
        P + "REMOTE_TIMEOUT_MS": "50",
    })
    assert (c.remote_url, c.remote_ttl_s, c.remote_admission, c.remote_timeout_ms) == (
        "rediss://kvtier@valkey.example:6380/0", 600, "reused", 50)
    assert OffloadConfig.from_env({}).remote_url == ""  # empty disables the remote tier


@pytest.mark.parametrize(("var", "value"), [
    ("REMOTE_URL", "http://host:6379"),
    ("REMOTE_URL", "redis://host"),
    ("REMOTE_TTL_S", "-1"),
    ("REMOTE_TTL_S", "soon"),
    ("REMOTE_ADMISSION", "sometimes"),
    ("REMOTE_TIMEOUT_MS", "0"),
    ("REMOTE_TIMEOUT_MS", "60001"),
])
def test_bad_remote_values_name_the_variable(var, value):
    env = {P + "REMOTE_SECRET_FILE": "/s", P + var: value}
    if var != "REMOTE_URL":
        env[P + "REMOTE_URL"] = "redis://127.0.0.1:6379"
    with pytest.raises(ConfigError, match=P + var):
        OffloadConfig.from_env(env)


def test_a_password_in_the_url_or_no_secret_is_refused():
    with pytest.raises(ConfigError, match="REMOTE_PASSWORD_FILE") as info:
        OffloadConfig(remote_url="redis://u:hunter2@h:6379", remote_secret_file="/s")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="REMOTE_SECRET_FILE"):
        OffloadConfig(remote_url="redis://h:6379")
    with pytest.raises(ConfigError, match="REMOTE_URL") as info:  # malformed: still not shown
        OffloadConfig(remote_url="redis://u:hunter2@h", remote_secret_file="/s")
    assert "hunter2" not in str(info.value)
