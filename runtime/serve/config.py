"""`ServeConfig` and `RayConfig`: how the server loads its replicas and admits requests; defaults live here.

Both are frozen and validate themselves on construction; the CLI maps its flags to their fields by
keyword, and the Ray Serve entry point takes them as they are (they pickle, so a Ray cluster gets
the same settings).
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import UserInputError
from paradecode.runtime.backends import BACKENDS
from paradecode.runtime.config import GenerationConfig, is_integer, positive_integer

DEVICES = ("cpu", "cuda")


def positive_number(value, name: str, unit: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise UserInputError(f"{name} must be a positive number{unit}, got {value!r}.")
    return float(value)


def non_negative_integer(value, name: str) -> int:
    if not is_integer(value) or value < 0:
        raise UserInputError(f"{name} must be an integer >= 0, got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class ServeConfig:
    """One server: an export, its replicas (each a whole model: weights, KV cache, lanes), and its limits.

    A replica decodes up to `max_batch` requests together (one batched call per subgraph for all of them), so a
    second replica pays only where one batch cannot use the machine: on a CPU, not at all (measured,
    tools/results/cpu-2core/loadtest-smollm2-batching.md).

    `generation` holds the decoding defaults every request starts from (mode, thresholds, overlap, K);
    a request sets only what the OpenAI API names (max_tokens, stop, ...). `threads` None divides the
    machine's cores between the lanes that compute at once in every replica, so replicas do not oversubscribe
    the CPU.
    """

    export: Path
    # None: the export folder's name (never its path: the model's id is public, the server's disk is not)
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the log says which)
    replicas: int = 1
    # requests a replica decodes together (continuous batching, runtime/engine.py); None: the export's --max-batch
    max_batch: int | None = None
    prefill_tokens: int = 512  # prompt tokens a batch prefills between two steps (at least one request's)
    max_queue: int = 16  # requests waiting for a free replica; one more gets 429
    request_timeout: float = 600.0  # seconds from arrival (reading, preparing and queueing included) to the last token
    read_timeout: float = 15.0  # seconds a client has to send a request's headers, and then its body
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    prepare_threads: int = 2  # requests parsed and tokenized at once (off the event loop)
    # bytes of request bodies over 64 KiB being parsed and tokenized or waiting for a thread, all requests together,
    # and as many of smaller ones: one more gets 429 (a flood of large prompts queues a few seconds of tokenizing at
    # most, and refuses no small request; runtime/serve/preparing.py)
    max_preparing_bytes: int = 8 << 20
    retry_after: int = 1  # seconds, the Retry-After header of a 429
    max_body_bytes: int = 4 << 20  # a larger request body gets 413
    completion_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    backend: str = "onnxruntime"
    device: str = "cpu"
    lanes: int = 2
    threads: int | None = None
    torch_compile: bool = False  # the torch backend's modules through torch.compile (runtime/backends/torch_backend.py)
    verify: bool = True
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.export, (str, os.PathLike)):
            raise UserInputError(f"export must be a folder path, got {self.export!r}.")
        object.__setattr__(self, "export", Path(self.export))
        name = self.served_model_name
        if name is None:
            name = self.export.resolve().name or "model"
        if not isinstance(name, str) or not name.strip():
            raise UserInputError(f"served_model_name must be a non-empty string, got {name!r}.")
        object.__setattr__(self, "served_model_name", name)
        if not isinstance(self.host, str) or not self.host:
            raise UserInputError(f"host must be a host name or address, got {self.host!r}.")
        if not is_integer(self.port) or not 0 <= self.port <= 65535:
            raise UserInputError(f"port must be an integer in 0..65535 (0: any free port), got {self.port!r}.")
        positive_integer(self.replicas, "replicas")
        if self.max_batch is not None:
            positive_integer(self.max_batch, "max_batch")
        positive_integer(self.prefill_tokens, "prefill_tokens")
        non_negative_integer(self.max_queue, "max_queue")
        positive_number(self.request_timeout, "request_timeout", " of seconds")
        positive_number(self.read_timeout, "read_timeout", " of seconds")
        positive_number(self.shutdown_timeout, "shutdown_timeout", " of seconds")
        positive_integer(self.prepare_threads, "prepare_threads")
        positive_integer(self.retry_after, "retry_after", " (seconds)")
        positive_integer(self.max_body_bytes, "max_body_bytes")
        positive_integer(self.max_preparing_bytes, "max_preparing_bytes")
        if self.max_preparing_bytes < self.max_body_bytes:
            raise UserInputError(
                f"max_preparing_bytes {self.max_preparing_bytes} is less than max_body_bytes {self.max_body_bytes}: "
                "a body of the largest size accepted could never be prepared. Raise max_preparing_bytes "
                "(--max-preparing-bytes) or lower max_body_bytes (--max-body-bytes)."
            )
        positive_integer(self.completion_max_tokens, "completion_max_tokens")
        if self.backend not in BACKENDS:
            raise UserInputError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}.")
        if self.device not in DEVICES:
            raise UserInputError(f"device {self.device!r} is not one of {', '.join(DEVICES)}.")
        positive_integer(self.lanes, "lanes")
        if self.threads is not None:
            positive_integer(self.threads, "threads")
        if not isinstance(self.torch_compile, bool):
            raise UserInputError(f"torch_compile must be True or False, got {self.torch_compile!r}.")
        if self.torch_compile and self.backend != "torch":
            raise UserInputError(
                f"torch_compile compiles the torch backend's modules, and backend is {self.backend!r}: serve with "
                "backend torch (--backend torch), or without torch_compile (--compile)."
            )
        if not isinstance(self.verify, bool):
            raise UserInputError(f"verify must be True or False, got {self.verify!r}.")
        if not isinstance(self.generation, GenerationConfig):
            raise UserInputError(f"generation must be a GenerationConfig, got {type(self.generation).__name__}.")

    def batch_rows(self, export_max_batch: int) -> int:
        """Requests one replica decodes together: `max_batch`, or the export's; refused past what the export holds."""
        if self.max_batch is None:
            return export_max_batch
        if self.max_batch > export_max_batch:
            raise UserInputError(
                f"max_batch {self.max_batch} is more rows than {self.export} holds (exported with --max-batch "
                f"{export_max_batch}): re-export with --max-batch {self.max_batch}, or serve with --max-batch "
                f"{export_max_batch} or less."
            )
        return self.max_batch

    @property
    def threads_per_call(self) -> int:
        """onnxruntime threads per call: as given, or the cores shared by the lanes that compute at once in every
        replica: all of a replica's lanes in the `streams` and `both` overlaps, its calling thread alone in
        `batched` (a CPU's `auto`: the side lanes stay idle, and a batch's calls are the calling thread's)."""
        if self.threads is not None:
            return self.threads
        computing = self.lanes if self.generation.overlap in ("streams", "both") else 1
        return max(1, (os.cpu_count() or 1) // (computing * self.replicas))

    def model_options(self) -> dict[str, Any]:
        """The keyword arguments of `paradecode.runtime.load` for one replica."""
        options: dict[str, Any] = dict(backend=self.backend, device=self.device, lanes=self.lanes, verify=self.verify)
        if self.backend == "onnxruntime":
            options["threads"] = self.threads_per_call
        if self.torch_compile:
            options["torch_compile"] = True
        return options


@dataclass(frozen=True)
class RayConfig:
    """A Ray Serve deployment of the server: `replicas` Ray actors, each one `ServeConfig` with one model.

    `num_cpus` / `num_gpus` are each replica's Ray resources. `autoscaling` is passed to Ray Serve
    unchanged (its `autoscaling_config`: min_replicas, max_replicas, target_ongoing_requests, ...)
    and replaces the fixed `replicas`. `max_ongoing_requests` is how many requests Ray sends one
    replica at once; None: twice what the replica holds (its batch of `max_batch` plus `max_queue` waiting), so a
    full replica answers 429 itself rather than Ray queueing without bound. `address` None starts
    or joins Ray the way `ray.init()` does (RAY_ADDRESS, else a local instance).
    """

    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    autoscaling: dict[str, Any] | None = None
    max_ongoing_requests: int | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        positive_integer(self.replicas, "replicas")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise UserInputError(f"{name} must be a number >= 0 (Ray resources per replica), got {value!r}.")
        if self.autoscaling is not None:
            if not isinstance(self.autoscaling, dict) or not all(isinstance(k, str) for k in self.autoscaling):
                raise UserInputError(
                    "autoscaling must be a JSON object of Ray Serve autoscaling_config fields such as "
                    f'{{"min_replicas": 1, "max_replicas": 4}}, got {self.autoscaling!r}.'
                )
            object.__setattr__(self, "autoscaling", json.loads(json.dumps(self.autoscaling)))  # a plain copy
        if self.max_ongoing_requests is not None:
            positive_integer(self.max_ongoing_requests, "max_ongoing_requests")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise UserInputError(
                f"address must be a Ray address such as 'auto' or 'ray://host:10001', got {self.address!r}."
            )
