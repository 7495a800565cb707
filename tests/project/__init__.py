"""The project itself: docs, benchmarks, tests/support, the private torch APIs."""
