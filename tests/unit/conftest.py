"""Every test under tests/unit is marked ``unit``: ``pytest tests/unit`` or ``pytest -m unit`` runs the fast tier.

In CI (``.ci/run``) the unit stage runs them first; its full stage then sets ``CKPTGUARD_UNIT_TIER_PASSED``
and they are deselected there rather than run twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unit = [item for item in items if _HERE in item.path.parents]
    for item in unit:
        item.add_marker(pytest.mark.unit)
    if os.environ.get("CKPTGUARD_UNIT_TIER_PASSED") and len(unit) < len(items):  # not a run of tests/unit alone
        config.hook.pytest_deselected(items=unit)
        items[:] = [item for item in items if _HERE not in item.path.parents]
