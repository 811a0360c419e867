"""The seams of a training run and of a checkpoint save, as one object: every method a no-op here.

The training loop (:func:`zerodp.train.loop.train`) and the checkpoint writer
(:func:`zerodp.train.checkpoint.save`) call one :class:`Hooks` object that is passed in, never a
module global: :class:`zerodp.train.faults.Faults` overrides the methods to make a rank fail on
purpose (the reliability tests and the chaos run), and a test can subclass it to meet a filesystem
error at one point of a save. A run without ``ZERODP_TEST_FAULT`` gets these no-ops.
"""

from __future__ import annotations

from pathlib import Path

#: The phases of a save, in order (:meth:`Hooks.save_phase`): every rank's shard written, then, on
#: rank 0, the manifest written, the directory renamed to its final name, ``COMPLETE`` written.
SAVE_PHASES = ("files", "manifest", "renamed", "complete")
#: The filesystem operations of a save (:meth:`Hooks.before_fs`): rank 0 creates the temporary
#: directory ("mkdir"), each rank writes its shard ("shard") and flushes it ("fsync"), rank 0 writes
#: the manifest ("manifest"), renames the directory ("rename") and writes the marker ("complete").
FS_POINTS = ("mkdir", "shard", "fsync", "manifest", "rename", "complete")


class Hooks:
    """What a run lets a test do at its seams; the base class does nothing at any of them."""

    def warning(self) -> str:
        """A line rank 0 prints before the run ("" for none): active hooks never act silently."""
        return ""

    def at_start(self, step: int) -> None:
        """Start-up of an attempt that begins at ``step`` (the process group is up, no checkpoint
        loaded yet)."""

    def at_step_start(self, step: int) -> None:
        """Before step ``step`` (0-based, the step about to be taken) starts its clock."""

    def after_backward(self, engine, step: int) -> None:
        """After the backward of every micro-batch of ``step``, before clipping and the optimizer step."""

    def save_phase(self, step: int, phase: str) -> None:
        """The save of the checkpoint of ``step`` reached ``phase`` (one of :data:`SAVE_PHASES`)."""

    def before_fs(self, point: str, step: int, path: Path) -> None:
        """Right before filesystem operation ``point`` (one of :data:`FS_POINTS`) of the save of
        ``step`` on ``path``; may raise ``OSError`` or change the filesystem."""


#: The hooks of a run without fault injection (stateless, so one instance serves every caller).
NO_HOOKS = Hooks()
