"""Saves: refusals agreed by every rank, per-rank values, async saves at exit, files= artifacts, manifest chunks."""
