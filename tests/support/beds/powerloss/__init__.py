"""Power-loss bed: record a real save's file-system operations through FUSE, then build and check
every disk state a power cut may leave (docs/testbeds.md, docs/crash-consistency.md)."""
