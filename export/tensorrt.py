"""TensorRT engines from the exported ONNX graphs, built through polygraphy.

Written against the documented TensorRT 10.x / 11.x Python API and polygraphy's loaders; kept
thin. Networks are strongly typed (precision comes from the ONNX types: TensorRT 11 has no
precision flags). Each subgraph gets optimization profiles for decode (T = 1), batched decode
(T up to K + 1) and prefill (longer T). A timing cache is shared across builds, and engines are
cached under a key hashing the ONNX file, the TensorRT version, the GPU and the profiles, so an
unchanged subgraph is not rebuilt.

Where TensorRT, polygraphy or a GPU is missing, `require_tensorrt` raises before anything is
written, naming what is missing and how to install it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import MissingDependencyError
from paradecode.graphs.manifest import sha256_of
from paradecode.graphs.tensors import SubgraphIO

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "Install TensorRT from NVIDIA's package index: `pip install paradecode[tensorrt] "
    "--extra-index-url https://pypi.nvidia.com` (the public `tensorrt` packages only download from there), "
    "on a machine with an NVIDIA GPU and driver."
)


@dataclass(frozen=True)
class TensorRTTarget:
    version: str
    gpu: str  # name and compute capability: engines are specific to both


@dataclass(frozen=True)
class ProfileSettings:
    max_batch: int
    max_seq_len: int
    max_unverified: int

    def token_ranges(self) -> list[tuple[int, int, int]]:
        """(min, opt, max) tokens per call: decode, batched decode of up to K+1 tokens, prefill."""
        batched_max = min(self.max_unverified + 1, self.max_seq_len)
        ranges = [(1, 1, 1)]
        if batched_max >= 2:
            ranges.append((2, batched_max, batched_max))
        if batched_max < self.max_seq_len:
            prefill_min = batched_max + 1
            ranges.append((prefill_min, max(prefill_min, min(128, self.max_seq_len)), self.max_seq_len))
        return ranges


def require_tensorrt() -> TensorRTTarget:
    """Import TensorRT and polygraphy and create a builder; raise MissingDependencyError naming what is missing."""
    try:
        import tensorrt as trt
    except ImportError as err:
        raise MissingDependencyError(
            f"--engine tensorrt needs TensorRT, which is not installed ({err}). {INSTALL_HINT}"
        ) from err
    try:
        import polygraphy.backend.trt  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(f"--engine tensorrt needs polygraphy: `pip install polygraphy` ({err}).") from err
    import torch

    if not torch.cuda.is_available():
        raise MissingDependencyError(
            "--engine tensorrt needs an NVIDIA GPU, and torch sees none (torch.cuda.is_available() is False). "
            "Build engines on the GPU they will run on, or export with --engine onnx."
        )
    try:
        trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as err:  # the bindings raise TypeError/RuntimeError when no device can be used
        raise MissingDependencyError(
            f"TensorRT {trt.__version__} cannot create a builder here ({err}). {INSTALL_HINT}"
        ) from err
    props = torch.cuda.get_device_properties(0)
    return TensorRTTarget(trt.__version__, f"{props.name} sm_{props.major}{props.minor}")


def profile_shapes(io: SubgraphIO, settings: ProfileSettings) -> list[dict[str, tuple[tuple[int, ...], ...]]]:
    """Per profile, (min, opt, max) shapes of every input of `io`. A KV cache has max_seq_len slots in every profile:
    the runtime binds a TensorRT engine's caches at fixed addresses, their whole length (runtime/kvcache.py)."""
    profiles = []
    slots = settings.max_seq_len
    for lo, opt, hi in settings.token_ranges():
        shapes = {}
        for t in io.inputs:
            shapes[t.name] = (
                t.concrete(1, lo, slots),
                t.concrete(1, opt, slots),
                t.concrete(settings.max_batch, hi, slots),
            )
        profiles.append(shapes)
    return profiles


def engine_key(onnx_path: Path, target: TensorRTTarget, profiles: list[dict[str, Any]]) -> str:
    payload = json.dumps({"onnx": sha256_of(onnx_path), "target": asdict(target), "profiles": profiles}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def engine_from_onnx(
    onnx_path: Path, io: SubgraphIO, settings: ProfileSettings, target: TensorRTTarget, cache_dir: Path
) -> tuple[Path, bool]:
    """Build (or reuse from `cache_dir`) the engine of one subgraph; return its cached path and whether it was built."""
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    shapes = profile_shapes(io, settings)
    key = engine_key(onnx_path, target, shapes)
    cached = cache_dir / "engines" / f"{io.name}-{key[:24]}.engine"
    if cached.is_file():
        logger.info("  %s: engine unchanged (cache %s)", io.name, cached.name)
        return cached, False
    profiles = []
    for profile_shapes_ in shapes:
        profile = Profile()
        for name, (lo, opt, hi) in profile_shapes_.items():
            profile.add(name, min=lo, opt=opt, max=hi)
        profiles.append(profile)
    timing_cache = cache_dir / "timing.cache"
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
    config = CreateConfig(profiles=profiles, load_timing_cache=str(timing_cache) if timing_cache.is_file() else None)
    serialized = EngineBytesFromNetwork(network, config=config, save_timing_cache=str(timing_cache))()
    if serialized is None:
        raise MissingDependencyError(f"TensorRT could not build an engine for {io.name} from {onnx_path.name}.")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(cached)
    return cached, True


def build_engines(
    folder: Path,
    plan: list[SubgraphIO],
    onnx_files: dict[str, str],
    settings: ProfileSettings,
    target: TensorRTTarget,
    cache_dir: Path,
) -> dict[str, str]:
    """Engines for every subgraph, copied into `folder/engines`; returns subgraph name -> relative path."""
    engines = {}
    (folder / "engines").mkdir(exist_ok=True)
    for i, io in enumerate(plan, 1):
        logger.info("[%2d/%d] %s: building TensorRT engine", i, len(plan), io.name)
        cached, _ = engine_from_onnx(folder / onnx_files[io.name], io, settings, target, cache_dir)
        relative = f"engines/{io.name}.engine"
        shutil.copy2(cached, folder / relative)
        engines[io.name] = relative
    return engines
