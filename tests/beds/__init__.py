"""Test beds: real torchrun jobs (jobs), NFS-like stale-cache storage (sshfs), a filesystem
that fills up (diskfull), and pytest fixtures for them (fixtures). See docs/testbeds.md."""
