"""Fixtures of the load tests."""

from __future__ import annotations

from typing import Any

import pytest

import ckptguard.protocol.load as load_module


@pytest.fixture
def metadata_requests(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The names each load asked DCP's metadata for (``manifest_metadata``'s ``wanted``), in order:
    whole tensors read from the item table are never among them."""
    asked: list[set[str]] = []
    build = load_module.manifest_metadata

    def spy(session: Any, name: Any, manifest: Any, wanted: Any = None) -> Any:
        asked.append(set(wanted))
        return build(session, name, manifest, wanted)

    monkeypatch.setattr(load_module, "manifest_metadata", spy)
    return asked
