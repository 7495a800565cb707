"""The commit protocol: what a save and a load do, phase by phase, and what they agree on.

    session.py    what a root's saves and loads share: ranks, storage, topology, lease
    save.py       plan, stage, write, commit, finish
    load.py       manifest, targets, read, restore, apply; fallback to an older checkpoint
    decisions.py  rank 0's decisions as pure functions
    root.py       the Root protocol (one root's control plane) and open_root, one root per URL scheme
    posixroot.py  PosixRoot: commit by rename          objstore.py  ObjectStoreRoot: by conditional create
    rootkit.py    what the two roots share             latest.py    the `latest` pointer
    lease.py      one writing job per root (fencing)
    topology.py   which ranks share storage: probed, never assumed
    artifacts.py  per-rank files= artifacts, and their collision check
    manifest.py   the manifest's JSON, strictly parsed
    layout.py     names on disk
    timing.py     per-phase timings, the GC pause

Internal: the public API is ``ckptguard.Checkpointer``.
"""
