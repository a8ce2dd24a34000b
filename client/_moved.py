"""Old import paths of the integrations, kept working after their move to ``kvtier.integrations``.

``kvtier.client.vllm_connector`` is the ``kv_connector_module_path`` users put in vLLM configs,
and ``kvtier.client.hf_cache`` / ``hf_static`` are the README's transformers imports. Importing
an old name gives the very module object of its new home (one set of classes, so ``isinstance``
and vLLM's connector registry agree), imported only when asked for: ``import kvtier.client``
never imports vLLM or transformers.

``install()`` adds the finder to ``sys.meta_path`` once (idempotent).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "kvtier.client.vllm_connector": "kvtier.integrations.vllm.connector",
    "kvtier.client.hf_cache": "kvtier.integrations.transformers.cache",
    "kvtier.client.hf_static": "kvtier.integrations.transformers.static",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds only the names in ``MOVED``; loading one imports (or reuses) its new module."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        return  # already executed under its new name


_FINDER = _MovedFinder()


def install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
