"""The torch APIs that differ across the supported range (``pyproject.toml``: torch 2.9 to 2.15), in
one place; docs/engine.md, "Supported torch versions", says which version brought what.

Each function here asks torch whether it has the feature (a keyword in a signature, an attribute),
never compares version strings, so a backport or a nightly behaves as what it is:

- :func:`launch_config` — ``LaunchConfig(signals_to_handle=...)`` exists from 2.10 and
  ``shutdown_timeout=...`` from 2.12; on an older torch the elastic agent keeps its own default
  (all four stop signals handled by the agent, a 30 s shutdown), which :func:`launch_limits` says.
- :func:`dynamo_disable` — ``torch._dynamo.disable(..., reason=...)`` exists from 2.8.

A difference that no function here can hide: before 2.12, the backward of a loss whose two operands
differ in dtype (``mse_loss(out.float(), target_bf16)``) raises ``Found dtype BFloat16 but expected
Float`` inside torch, whatever wraps the model — ``mixed_precision="bf16"`` casts every floating
input of ``forward`` to the compute dtype, as FSDP2's ``cast_forward_inputs`` does, a float target
passed to the model included. docs/engine.md says what to write instead.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def launch_config(**kwargs: Any):
    """``torch.distributed.launcher.api.LaunchConfig(**kwargs)`` without the keywords this torch's
    class does not take (see :func:`launch_limits`)."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(**{k: v for k, v in kwargs.items() if _accepts(LaunchConfig, k)})


def launch_limits() -> list[str]:
    """What the launcher cannot do on this torch, one sentence each (empty on 2.12 and newer)."""
    from torch.distributed.launcher.api import LaunchConfig

    out = []
    if not _accepts(LaunchConfig, "signals_to_handle"):
        out.append("torch < 2.10: the elastic agent handles SIGTERM and SIGINT itself, so a stop signal ends "
                   "the ranks without the graceful checkpoint (torchrun-launched runs keep it)")
    if not _accepts(LaunchConfig, "shutdown_timeout"):
        out.append("torch < 2.12: the agent waits its default 30 s for the ranks after a stop signal, not "
                   "--grace-s")
    return out


def dynamo_disable(fn: Callable, reason: str) -> Callable:
    """``torch._dynamo.disable(fn, recursive=True, reason=reason)``; the reason is dropped where
    this torch's ``disable`` takes none."""
    import torch._dynamo

    if _accepts(torch._dynamo.disable, "reason"):
        return torch._dynamo.disable(fn, recursive=True, reason=reason)
    return torch._dynamo.disable(fn, recursive=True)

