"""Durable writes: a file's bytes and a directory's entries forced to disk before anything relies
on them (the atomic write-then-rename of checkpoints and exported weights)."""

from __future__ import annotations

import os
from pathlib import Path


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the entries created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
