"""Rewrite a real checkpoint's manifest field by field and reseal it (the checksum is not a signature)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from ckptguard.protocol.manifest import seal


def manifest_path(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}" / "MANIFEST.json"


def split(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """The manifest's JSON body and its row section (MessagePack, untyped)."""
    nl = data.index(b"\n")
    body = json.loads(data[:nl])["body"]
    tables = msgspec.msgpack.decode(data[nl + 1 :])
    return body, tables


def join(body: dict[str, Any], tables: list[Any], *, raw_body: bytes | None = None) -> bytes:
    """Resealed manifest bytes; ``rows.bytes`` follows the row section unless the caller set it."""
    packed = msgspec.msgpack.encode(tables)
    body.setdefault("rows", {})["bytes"] = len(packed)
    text = raw_body if raw_body is not None else json.dumps(body, separators=(",", ":")).encode()
    return seal(text, packed)


def rewrite(root: Path, step: int, change: Callable[[dict[str, Any], list[Any]], Any]) -> None:
    """Apply ``change(body, tables)`` to step's manifest and reseal it; a change that returns bytes gives
    the JSON body verbatim (for values json.dumps cannot write)."""
    path = manifest_path(root, step)
    body, tables = split(path.read_bytes())
    raw = change(body, tables)
    path.write_bytes(join(body, tables, raw_body=raw if isinstance(raw, bytes) else None))
