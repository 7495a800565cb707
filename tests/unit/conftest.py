"""Every test under tests/unit is marked ``unit``: ``pytest tests/unit`` or ``pytest -m unit`` runs the fast tier."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.unit)
