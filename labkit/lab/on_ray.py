"""Sweeps on Ray (`python -m labkit sweep FILE --backend ray [--address ADDR]`): each run of a
sweep is one Ray task that declares the CPUs and GPUs it needs, and Ray places the tasks on
its cluster as resources free up.

With no address labkit starts a local cluster for the sweep and stops it at the end; with an
address (`ray://...` or `HOST:PORT`, as `ray.init` takes it) it joins a running cluster,
whose nodes must see the run folders and notebooks at the same paths (a shared filesystem)
and have labkit installed. A task whose worker process dies (a node lost, the process
killed, memory exhausted) is run again, at most `MAX_RETRIES` times, in a fresh run folder;
after that the run is reported as failed with the error and the other runs go on. A run
that fails in its notebook is not retried: its error is the notebook's. Ray is the optional
`cluster` extra: `pip install 'labkit[cluster]'`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

MAX_RETRIES = 2
"""How many times a run whose worker died is started again before it counts as failed."""


def require_ray():
    """The `ray` module, or ImportError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ImportError("--backend ray needs Ray: pip install 'labkit[cluster]'") from None
    return ray


def run_tasks(execute: Callable[..., str], jobs: list[tuple[object, tuple]],
              finish: Callable[[object, str], None], *, address: str | None = None,
              cpus: float = 1, gpus: float = 0, local_cpus: int | None = None,
              max_retries: int = MAX_RETRIES) -> None:
    """Run `execute(*args)` for each (key, args) of `jobs` as a Ray task with `cpus` CPUs and
    `gpus` GPUs, and call `finish(key, message)` as each ends ('' on success, else one line).
    Joins the cluster at `address`; without one, starts a local cluster of `local_cpus`
    CPUs (Ray's default: all of them) and shuts it down at the end. A Ray session already
    started in this process is used as it is."""
    ray = require_ray()
    started = False
    if not ray.is_initialized():
        options = dict(include_dashboard=False, log_to_driver=False,
                       logging_level=logging.WARNING)
        if address:
            ray.init(address=address, **options)
        else:
            ray.init(num_cpus=local_cpus, **options)
        started = True
    try:
        task = ray.remote(num_cpus=cpus, num_gpus=gpus, max_retries=max_retries,
                          retry_exceptions=False)(execute)
        keys = {task.remote(*args): key for key, args in jobs}
        pending = list(keys)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ref = done[0]
            try:
                message = ray.get(ref)
            except ray.exceptions.RayError as e:  # the worker died, after every retry
                first = " ".join(str(e).split())[:200]
                message = (f"its worker died {max_retries + 1} times "
                           f"({type(e).__name__}: {first})")
            finish(keys[ref], message)
    finally:
        if started:
            ray.shutdown()
