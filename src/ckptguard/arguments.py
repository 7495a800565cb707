"""The checks of the Checkpointer's arguments: a wrong type or value is refused naming the argument,
rather than failing later, on some ranks, in the middle of a collective. ``settings.py`` applies them to
every setting; the methods apply them to their own arguments (``metadata=``).
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Mapping
from typing import Any

from ckptguard.checksum import ALGORITHMS
from ckptguard.protocol import records


def check_root(root: Any) -> None:
    """A path or a URL; anything else is refused naming ``root``."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path or a URL (str or os.PathLike), got {type(root).__name__}")


def flag(name: str, value: Any) -> bool:
    """``value`` checked to be True or False (not a truthy string: ``read_only="no"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {value!r}")
    return value


def count(name: str, value: Any, minimum: int, why: str = "", *, optional: bool = False) -> int | None:
    """``value`` checked to be an int >= ``minimum`` (or None where ``optional``): refused at the door,
    naming the argument, rather than failing later in a comparison (``keep_last='3'``)."""
    if value is None and optional:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # int, numpy integers; not float, str or bool
    except TypeError:
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}" + (f" ({why})" if why else "") + f", got {number}")
    return number


def check_process_group(group: Any) -> None:
    """None, "local" or a torch ProcessGroup; anything else (a typo "locl", a list of ranks) would
    otherwise quietly give a Checkpointer over the whole world."""
    if group is None or (isinstance(group, str) and group == "local"):
        return
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return
    hint = " (a list of ranks? pass torch.distributed.new_group(ranks, backend='gloo'))" \
        if isinstance(group, (list, tuple, range)) else ""
    raise TypeError(f"process_group must be None (all ranks), \"local\" (this rank alone) or a "
                    f"torch.distributed ProcessGroup, got {group!r} ({type(group).__name__}){hint}")


def required(value: int | None) -> int:
    assert value is not None  # count without optional=True never returns None
    return value


def seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value}")
    return float(value)


def checksum_name(value: Any) -> str:
    if value not in ALGORITHMS:
        raise ValueError(f"checksum must be one of {', '.join(ALGORITHMS)}, got {value!r}")
    return str(value)


def json_object(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of str to JSON values (metadata={{'loss': 1.5}}), got "
                        f"{metadata!r} ({type(metadata).__name__})")
    try:
        text = json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"metadata must be JSON-serializable: {e}") from None
    # Bounded as a load will bound it: a manifest that no load could read is never written.
    result: dict[str, Any] = records.parse_json(text, "metadata=", "user metadata", max_bytes=None,
                                                max_depth=records.MAX_MANIFEST_DEPTH - 2)
    return result
