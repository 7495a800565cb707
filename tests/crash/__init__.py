"""Crash consistency: power loss, the campaign, the model-based test, reliability, stale caches, the beds."""
