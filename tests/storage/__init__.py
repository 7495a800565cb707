"""Storage: the backends, every Root's conformance, S3 against a real endpoint."""
