"""Storage beds: NFS-like stale-cache storage (sshfs) and a filesystem that fills up (diskfull).
See docs/testbeds.md."""
