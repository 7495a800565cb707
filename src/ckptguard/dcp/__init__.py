"""The data path: DCP plans what each rank writes and reads; these modules do the I/O.

    codec.py           tensors as raw bytes; DCP's metadata as JSON (never pickle)
    planners.py        DCP planners: one copy per storage domain, per-rank values caught, safe objects
    writer.py          StorageWriter: straight from tensor memory into new files, checksummed
    reader.py          StorageReader: ranged reads into destinations, every byte verified
    drive.py           dcp.save / dcp.load planning driven by ckptguard's agreement steps
    _torch_private.py  every private torch API used, checked against the tested torch versions

Internal: the public API is ``ckptguard.Checkpointer``.
"""
