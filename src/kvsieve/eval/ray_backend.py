"""Optional Ray backend: each (cell, batch) is a Ray task; the driver writes rows as tasks finish.

Ray is an optional extra (``pip install ray``).  ``address=None`` joins the cluster named by
``RAY_ADDRESS`` or starts a local one; ``"local"`` always starts a private single-node cluster
(Ray >= 2.50 has no in-process "local mode").  Workers load the model once per process and keep
it for their later tasks; ``OMP_NUM_THREADS`` is passed on to them.  Rows are the same as
in-process rows: the same ``run_batch`` produces them, and only the driver writes the store.
A steering vector (``--steering``) is read once by the driver and shipped with the tasks, so
workers need no access to the file; each worker checks it against its own model.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .config import Cell, EvalConfig
from .config import split_steer
from .runner import batches, load_steering_vector, make_steering, run_batch

_MODELS: dict[tuple[str, str, str], tuple] = {}


def _model(config: EvalConfig):
    key = (config.model, config.device, config.dtype)
    if key not in _MODELS:
        from ..models import load_model

        _MODELS[key] = load_model(config.model, device=config.device, dtype=config.dtype)
    return _MODELS[key]


def _batch_task(config: EvalConfig, cell: Cell, samples, vector=None) -> tuple[Cell, list[dict]]:
    model, tokenizer = _model(config)
    steering = make_steering(config, model, vector) if split_steer(cell[0])[1] else None
    return cell, run_batch(model, tokenizer, config, cell, samples, steering)


def task_gpus(num_gpus: float | None, device: str, cluster_gpus: float) -> float:
    """GPUs each task asks Ray for: ``num_gpus`` when given, else one GPU per task when the
    cluster has GPUs and the model may go there (``device`` auto or cuda), else none.  Without a
    request Ray hides the GPUs from a task, and every task would load the model onto the CPU."""
    if num_gpus is not None:
        if num_gpus < 0:
            raise ValueError(f"--ray-gpus must be >= 0, not {num_gpus}")
        return num_gpus
    return 1.0 if cluster_gpus > 0 and (device == "auto" or device.startswith("cuda")) else 0.0


def run_on_ray(config: EvalConfig, work, write: Callable[[Cell, list[dict]], None], address: str | None = None,
               num_gpus: float | None = None, init: dict[str, Any] | None = None) -> None:
    """Submit every pending (cell, batch) and hand each finished batch's rows to ``write``.

    ``num_gpus`` is requested per task (``task_gpus``; None: one per task on a cluster with GPUs);
    ``init`` holds extra ``ray.init`` arguments (e.g. ``num_cpus``).
    """
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install 'ray>=2.9' (or drop --ray to run in-process)") from None
    started = not ray.is_initialized()
    if started:
        env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "KVSIEVE_CACHE", "KVSIEVE_DATA") if k in os.environ}
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env} if env else None, **(init or {}))
    try:
        gpus = task_gpus(num_gpus, config.device, ray.cluster_resources().get("GPU", 0))
        remote = ray.remote(num_gpus=gpus)(_batch_task)
        config_ref = ray.put(config)
        vector_ref = ray.put(load_steering_vector(config))  # None without --steering
        futures = [remote.remote(config_ref, cell, batch, vector_ref)
                   for cell, pending in work for batch in batches(pending, config.batch_size)]
        while futures:
            finished, futures = ray.wait(futures, num_returns=1)
            cell, rows = ray.get(finished[0])
            write(cell, rows)
    finally:
        if started:
            ray.shutdown()
