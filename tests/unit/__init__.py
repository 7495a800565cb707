"""The fast tier: pure logic, no processes, no torchrun (``pytest tests/unit``, under two minutes)."""
