"""An OpenAI-compatible HTTP server over a paradecode export: `paradecode-serve DIR`.

    import uvicorn
    from paradecode.runtime.serve import ServeConfig
    from paradecode.runtime.serve.app import build_app
    from paradecode.runtime.serve.service import Service

    with Service(ServeConfig("out/model", replicas=2)) as service:  # loads 2 models, frees them at the end
        uvicorn.run(build_app(service), host="127.0.0.1", port=8000)

Modules: `config` (ServeConfig, RayConfig), `requests` (OpenAI request bodies -> GenerationConfig),
`pool` (replicas and their worker threads: the threading model), `service` (pool + metrics +
request preparation), `generation` (one request on the event loop, whole or streamed), `responses`
(OpenAI's response and chunk objects), `stops` (stop strings), `metrics` (Prometheus), `app`
(FastAPI routes), `ray_serve` (the Ray Serve deployment), `cli` (paradecode-serve).

It imports only `paradecode.runtime` and `paradecode.graphs` (never transformers or the exporter),
and needs the `serve` extra (FastAPI, uvicorn, prometheus_client); Ray Serve needs the `ray` extra.
Importing this package imports none of them, nor torch: each module does, when it is imported, and
`ServeConfig` / `RayConfig` are imported when first used (PEP 562), so `paradecode-serve` starts at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["RayConfig", "ServeConfig"]

if TYPE_CHECKING:
    from paradecode.runtime.serve.config import RayConfig, ServeConfig


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from paradecode.runtime.serve import config

    value = getattr(config, name)
    globals()[name] = value
    return value
