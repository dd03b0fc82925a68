"""Which restart of the job this is, as torchrun (``--max-restarts N``) counts them.

torchrun's agent on each node restarts its workers when one of them fails (a crash, a kill,
a collective that timed out) and tells them in ``TORCHELASTIC_RESTART_COUNT`` /
``TORCHELASTIC_MAX_RESTARTS``. Each node counts for itself: a node whose own workers were
healthy restarts them without counting (torch 2.13, ``SimpleElasticAgent._invoke_run``), so
after a failure on node 1 node 0 still says 0. The job gives up when one node has used its N
restarts, so the count that matters is the highest over the nodes: :func:`restart_of_job`
takes the maximum over all ranks.
"""

import os

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun in each worker: restarts of this node's workers so far."""
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
"""Set by torchrun in each worker: its ``--max-restarts``."""


def restart_of_job() -> tuple[int, int]:
    """This attempt's restart number and the most restarts allowed.

    A collective when a process group exists: call it on every rank.

    Returns:
        ``(restart, max_restarts)``: ``(0, 0)`` outside torchrun; ``restart`` is the highest
        count over all ranks (torchrun counts per node).
    """
    restart = _int_env(RESTART_COUNT_ENV)
    max_restarts = _int_env(MAX_RESTARTS_ENV)
    import torch  # Here: `tunelab run` imports the lifecycle package without torch.
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = torch.tensor([restart, max_restarts], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # A CPU tensor: gloo on any backend.
        restart, max_restarts = (int(value) for value in counts.tolist())
    return restart, max_restarts


def restart_follows() -> bool:
    """Whether torchrun will restart this node's workers if this one fails now (no collective)."""
    return _int_env(RESTART_COUNT_ENV) < _int_env(MAX_RESTARTS_ENV)


def _int_env(name: str) -> int:
    try:
        return max(int(os.environ.get(name, "0")), 0)
    except ValueError:
        return 0
