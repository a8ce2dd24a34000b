"""Token ids as callers hand them over, made into one plain list.

``token_list(token_ids) -> list[int]``: a list of ints is taken as it is (not copied: the key
chains copy what they remember); a tuple, range, 1-D tensor or array becomes a list of Python
ints (``tolist``), so the store never keeps a view of the caller's buffer, which a later
in-place edit would change. A batch of one (``[1, n]``, what tokenizers and ``generate``
return) is taken as its one row; a larger batch or a scalar is refused
(``InvalidArgument("token_ids")``): a store holds one conversation per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.errors import InvalidArgument


def token_list(token_ids: Sequence[int] | Any) -> list[int]:
    ids: Any = token_ids
    tolist = getattr(ids, "tolist", None)
    if tolist is not None and hasattr(ids, "ndim"):  # a torch tensor or a numpy array
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        elif ids.ndim != 1:
            raise InvalidArgument("token_ids", f"need one sequence of ids (or a batch of one), "
                                               f"got shape {list(ids.shape)}")
        out = ids.tolist()
        if out and not isinstance(out[0], int):
            raise InvalidArgument("token_ids", f"need integer ids, got {type(out[0]).__name__}")
        return out
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise InvalidArgument("token_ids", f"need a sequence of ids, got {type(ids).__name__}")
    if len(ids) and not isinstance(ids[0], int):
        if len(ids) == 1 and isinstance(ids[0], Sequence):
            return token_list(ids[0])  # a batch of one as nested lists
        if hasattr(ids[0], "ndim"):  # 0-d tensors: views of the caller's buffer
            return token_list([int(i) for i in ids])
        raise InvalidArgument("token_ids", f"need integer ids, got {type(ids[0]).__name__}")
    return ids if isinstance(ids, list) else list(ids)
