"""The root conftest: pytest puts this directory (the repository root) on sys.path, so tests
import their shared code as ``tests.support``, and every test gets the beds' fixtures
(``sshfs_bed``, ``small_fs``) without importing them."""

pytest_plugins = ["tests.support.fixtures"]
