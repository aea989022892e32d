"""Ray Serve: the same FastAPI app as `paradecode-serve`, one model per Ray replica, scaled by Ray.

    import ray
    from ray import serve
    from paradecode.runtime.serve import RayConfig, ServeConfig
    from paradecode.runtime.serve.ray_serve import deployment

    ray.init()  # or ray.init(address="auto") on a cluster
    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(deployment(ServeConfig("out/model"), RayConfig(replicas=2, num_cpus=2)), name="paradecode",
              route_prefix="/")

Each Ray replica is an actor that runs `app_from_config` with one model: the app's ASGI lifespan
loads the export when the replica starts and frees it when Ray stops the replica. Ray's router
spreads requests over the replicas; each replica keeps its own bounded queue (429 when full) and
request timeout. `RayConfig` passes `num_cpus` / `num_gpus` per replica and Ray's
`autoscaling_config` through unchanged. On a cluster, every node needs paradecode installed and the
export folder at the same path (a shared file system).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from paradecode.graphs.errors import MissingDependencyError, UserInputError, interrupts_raised
from paradecode.graphs.manifest import read_manifest
from paradecode.runtime.serve.config import RayConfig, ServeConfig

logger = logging.getLogger(__name__)

APP_NAME = "paradecode"  # the Ray Serve application's name, and its deployment's


def import_serve():
    try:
        from ray import serve
    except ImportError as err:
        raise MissingDependencyError(f"--ray needs Ray Serve: `pip install paradecode[ray]` ({err}).") from err
    return serve


class ParaDecodeReplica:
    """One Ray Serve replica. Its app (built by `serve.ingress`'s builder on the replica) owns the model."""


def replica_config(config: ServeConfig, ray_config: RayConfig) -> ServeConfig:
    """What one Ray replica runs: one model, with threads from its Ray CPUs unless `config.threads` says."""
    threads = config.threads if config.threads is not None else max(1, int(ray_config.num_cpus) // config.lanes)
    return replace(config, replicas=1, threads=threads)


def deployment_options(config: ServeConfig, ray_config: RayConfig) -> dict:
    """`serve.deployment` keyword arguments: resources, replicas or autoscaling, concurrency, shutdown grace."""
    # twice what a replica holds: its batch (the export's --max-batch unless config says) and its queue
    rows = config.max_batch or read_manifest(config.export).max_batch
    ongoing = ray_config.max_ongoing_requests or 2 * (rows + config.max_queue)
    options = dict(
        name=APP_NAME,
        ray_actor_options={"num_cpus": ray_config.num_cpus, "num_gpus": ray_config.num_gpus},
        max_ongoing_requests=ongoing,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
    )
    if ray_config.autoscaling is not None:
        options["autoscaling_config"] = checked_autoscaling(ray_config.autoscaling)
    else:
        options["num_replicas"] = ray_config.replicas
    return options


def checked_autoscaling(settings: dict) -> dict:
    """`settings` as Ray Serve's AutoscalingConfig validates them; a UserInputError names what Ray refused."""
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig(**settings)
    except (TypeError, ValueError) as err:
        raise UserInputError(f"autoscaling {settings!r} is not a valid Ray Serve autoscaling_config: {err}") from err
    return settings


def deployment(config: ServeConfig, ray_config: RayConfig):
    """The Ray Serve application (`serve.run` it): `ray_config.replicas` replicas of the app, one model each."""
    serve = import_serve()
    per_replica = replica_config(config, ray_config)

    def build_app():  # runs on each replica, in its own process
        from paradecode.runtime.serve.app import app_from_config

        return app_from_config(per_replica)

    ingress = serve.ingress(build_app)(ParaDecodeReplica)
    return serve.deployment(ingress, **deployment_options(config, ray_config)).bind()


def run(config: ServeConfig, ray_config: RayConfig) -> None:
    """`paradecode-serve --ray`: start or join Ray, serve until interrupted, then remove the application.

    SIGTERM or Ctrl-C (raised here by the CLI's handlers) deletes the application; Ray waits up to
    `config.shutdown_timeout` seconds for each replica's requests to finish.
    """
    import ray

    serve = import_serve()
    ray.init(address=ray_config.address, include_dashboard=False)
    # ray.init replaces SIGTERM's handler (with sys.exit, behind a C++ handler that aborts the process): take
    # SIGTERM and SIGINT back, so that they unwind through the `finally` below as they do everywhere else.
    with interrupts_raised():
        try:
            serve.start(http_options={"host": config.host, "port": config.port})
            serve.run(deployment(config, ray_config), name=APP_NAME, route_prefix="/")
            logger.info("serving %s on http://%s:%d with Ray Serve", config.served_model_name, config.host, config.port)
            while True:
                time.sleep(3600)
        finally:
            logger.info("removing the Ray Serve application")
            serve.delete(APP_NAME)
            ray.shutdown()
