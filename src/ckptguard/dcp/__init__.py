"""The data path: DCP plans what each rank writes and reads; these modules do the I/O.

    codec.py           tensors as raw bytes; DCP's metadata as JSON (never pickle)
    planners.py        the save planner: one copy per storage domain, per-rank values caught
    loadplanner.py     the load planner (safe objects) and ReaderPlanner, its contract with the reader
    writer.py          StorageWriter: straight from tensor memory into new files, checksummed
    reader.py          StorageReader: ranged reads into destinations, every byte verified
    readjob.py         one item of a load (in place, staged or verified only); the arena, the spill
    coverage.py        a load's reads cover every destination element exactly once
    loadmemory.py      what a load may hold in memory, how many files it may keep open
    drive.py           dcp.save / dcp.load planning driven by ckptguard's agreement steps
    _torch_private.py  every private torch API used, checked against the tested torch versions

Internal: the public API is ``ckptguard.Checkpointer``.
"""
