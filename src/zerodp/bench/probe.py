"""Per-process counters the bench reads the same way for our engine and for every PyTorch peer.

Peers cannot be asked what they hold or send (DDP's reducer and gloo live in C++), so the bench
measures from outside, through Linux's ``/proc``, identically for every contender:

- **bytes sent**: ``wchar`` of ``/proc/self/io`` — bytes this process passed to ``write``-family
  system calls. Gloo moves tensors over TCP sockets with ``writev``, so during a training step
  (when nothing else writes) its growth is the bytes this rank put on the wire, headers included.
  Checked on 2 gloo ranks: an AllReduce of V bytes grows it by V = 2(N−1)/N·V (guide §2.4).
- **peak memory**: ``VmHWM`` (the resident-set high-water mark) of ``/proc/self/status``, reset
  by writing ``5`` to ``/proc/self/clear_refs``. After ``gc.collect()`` and glibc's
  ``malloc_trim(0)`` (which returns freed heap pages), high-water mark minus the resident set
  before is the peak *extra* memory a piece of work needed: model states, activations,
  communication buffers, allocator slack.

Where ``/proc`` is missing (not Linux) the readers return ``None`` and the bench says "n/a".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

from zerodp.train.config import Mode

_IO = "/proc/self/io"
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_PEAK_RSS = "5"  # proc(5): "5" resets the peak resident set size (VmHWM), Linux >= 4.0
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 128 << 10  # glibc's initial value, kept fixed by set_malloc("mmap")


class Malloc(Mode):
    """``zerodp bench --malloc``: glibc's allocator as it comes, or its mmap threshold fixed."""

    DEFAULT = "default"
    MMAP = "mmap"


MALLOC_MODES = tuple(m.value for m in Malloc)


def bytes_written() -> int | None:
    """Bytes this process has written through write/writev/send so far (``wchar``)."""
    try:
        with open(_IO) as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """The resident set size now."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """The resident set high-water mark since the process started or the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def set_malloc(mode: str) -> bool:
    """``"mmap"``: glibc's ``mallopt(M_MMAP_THRESHOLD, 128 KiB)`` in this process, so that every
    buffer of 128 KiB or more is its own mapping, returned to the system when freed, and ``VmRSS``
    follows the live tensors; ``"default"``: glibc as it comes (its threshold then grows with the
    buffers freed, up to 32 MiB, and later ones come from the heap, whose holes stay resident).
    False where glibc is not there."""
    if Malloc.parse(mode, "malloc", optional=False) is Malloc.DEFAULT:
        return True
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except AttributeError:  # a C library without mallopt
        return False


def _libc() -> ctypes.CDLL | None:
    """The C library (glibc's ``mallopt`` and ``malloc_trim``), or None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _malloc_trim() -> None:
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass


def reset_peak() -> int | None:
    """Collect garbage, give freed heap back to the OS, reset VmHWM; return the RSS to measure from."""
    gc.collect()
    _malloc_trim()
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write(_RESET_PEAK_RSS)
    except OSError:
        return None
    return rss_bytes()


class PeakMemory:
    """``with PeakMemory() as m: work()`` then ``m.bytes``: the work's peak RSS growth (or None)."""

    def __init__(self):
        self.start: int | None = None
        self.bytes: int | None = None

    def __enter__(self) -> "PeakMemory":
        self.start = reset_peak()
        return self

    def __exit__(self, *exc) -> None:
        peak = peak_rss_bytes()
        if self.start is not None and peak is not None:
            self.bytes = max(0, peak - self.start)


def available() -> bool:
    """True when both counters can be read here."""
    return bytes_written() is not None and peak_rss_bytes() is not None and os.path.exists(_CLEAR_REFS)


def machine() -> dict:
    """What the figures were measured on: cores, memory, load, torch and Python versions."""
    import platform

    import torch

    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_bytes": memory, "load_average_1_5_15": load, "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
