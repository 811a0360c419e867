"""Replica groups that survive a failure and heal from a live peer (issue 52, docs/reliability.md).

Hybrid sharding with each replica group a job of its own: ZeRO (stages 0-3) inside a group of g
ranks (its own ``torch.distributed`` process group, its own rendezvous), and across the groups
torchft — a lighthouse that forms quorums, a ``torchft.Manager`` per rank, a reconfigurable gloo
process group joining the ranks with the same shard index in every live group. A failure ends
only the failed group; the others step on at the live count; the group that comes back fetches
each rank's shard from the rank with the same index in a live group and steps on bitwise equal.

- :class:`~zerodp.ft.replicas.ReplicaGroups`: given to ``parallelize(..., replicas=...)``; the
  engine's cross-group gradient reduction and its commit gate, and the healing state.
- :mod:`zerodp.ft.launch`: a lighthouse and R groups of g local ranks, for demos and tests.
"""

from zerodp.ft.replicas import ReplicaGroups

__all__ = ["ReplicaGroups"]
