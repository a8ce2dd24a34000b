"""``kv_connector_extra_config`` is checked once: a bad value names the key and what is accepted."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm.connector import ConnectorOptions, KVTierConnectorMetadata

pytestmark = pytest.mark.vllm


def test_defaults_are_async_stores_and_layer_loads() -> None:
    o = ConnectorOptions.from_extra({"address": "unix:///x"})
    assert (o.stores, o.loads, o.store_wait_s, o.store_timeout_s) == ("async", "layer", 1.0, 30.0)
    assert o.load_groups == "auto"  # 8 layer groups under MPS, else 1 (groups.auto_groups)
    assert ConnectorOptions.from_extra({"address": "unix:///x", "load_groups": 4}).load_groups == 4
    meta = KVTierConnectorMetadata(loads=[], stores=[])
    assert meta.delayed == [] and meta.flush is False


@pytest.mark.parametrize(("extra", "named"), [
    ({"stores": "later"}, "stores='later'; accepted: async|sync"),
    ({"loads": "pages"}, "loads='pages'; accepted: layer|block"),
    ({"store_wait_s": -1}, "store_wait_s=-1"),
    ({"store_timeout_s": "30"}, "store_timeout_s='30'"),
    ({"timeout": True}, "timeout=True"),
    ({"load_groups": 0}, "load_groups=0; accepted: auto or an integer 1..4096"),
    ({"load_groups": "4"}, "load_groups='4'"),
    ({"load_groups": "AUTO"}, "load_groups='AUTO'"),
    ({"load_groups": True}, "load_groups=True"),
])
def test_bad_values_are_refused_by_name(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config") as err:
        ConnectorOptions.from_extra({"address": "unix:///x", **extra})
    assert named in str(err.value)
