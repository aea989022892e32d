"""The ecosystem's runtimes as benchmark modes: onnxruntime-genai (plain and n-gram), llama.cpp and OpenVINO GenAI
(plain and prompt lookup).

`paradecode-bench --peers ort-genai,llama.cpp,openvino` measures what a user would pick instead of paradecode
beside `ar` and ParaDecode, in the same rounds (docs/design.md §6): the same prompt token ids, greedy, the
same new-token budget and stop tokens, every core.

- `ort-genai`: onnxruntime-genai on the model its own model builder makes from the export's source
  (`paradecode.tools.peer_models`), decoding plainly; and `ort-genai-ngram`, the same model with the
  library's n-gram speculation (`NGRAM_OPTIONS`).
- `llama.cpp`: llama-cpp-python on the GGUF file the export came from.
- `openvino`: OpenVINO GenAI's `LLMPipeline` on the CPU, on the model optimum-intel converts from the export's
  source with int8, int4 or fp32 weights (`paradecode.tools.peer_models`), decoding plainly; and `openvino-lookup`,
  the same model with the library's prompt lookup (`OPENVINO_LOOKUP_OPTIONS`).

A runner owns its library's objects and has one lifecycle: `load()`, then `generate(ids, max_new_tokens)`
any number of times, then `close()` (or `with runner.load(): ...`). Each library is imported in `load`,
so importing this module (and `paradecode.tools.bench`) never imports them. The benchmark runs each peer's runner in
a process of its own (tools/peer_process.py), so that a peer that crashes ends itself, not the run.

Threading model: a runner is used by one thread at a time (the harness calls modes one after another);
each `generate` call makes its own per-request state (a genai `Generator`; llama.cpp's context is reset; OpenVINO
GenAI's pipeline starts each `generate` from an empty KV cache). OpenVINO GenAI calls its streamer back on the
thread that called `generate`, so its tokens are timed there too.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import MissingDependencyError, UserInputError
from paradecode.runtime.config import GenerationConfig
from paradecode.tools.harness import Mode, Sample

logger = logging.getLogger(__name__)

PEERS = ("ort-genai", "llama.cpp", "openvino")  # what --peers accepts
PRECISIONS = ("int4", "fp32")  # onnxruntime-genai's builder precisions offered for its CPU models
# optimum-intel's weight formats offered for OpenVINO's models (peer_models.OPENVINO_WEIGHT_OPTIONS says how each is
# made): int8 beside paradecode's default export, int4 beside `--weights int4`, fp32 to check against transformers.
OPENVINO_WEIGHTS = ("int8", "int4", "fp32")
INSTALL = "pip install 'paradecode[peers]'"
# The import name and the distribution of each peer's packages (its model builder also needs onnx_ir). The openvino
# peer's converter, optimum-intel, is looked for in the Python that converts (peer_models.openvino_converter), which
# need not be this one: optimum-intel 2.2 requires transformers < 5.6.
PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "ort-genai": (("onnxruntime_genai", "onnxruntime-genai"), ("onnx_ir", "onnx-ir")),
    "llama.cpp": (("llama_cpp", "llama-cpp-python"),),
    "openvino": (("openvino_genai", "openvino-genai"),),
}
# onnxruntime-genai's n-gram speculation (`GeneratorParams.set_speculative_options`, onnxruntime-genai
# >= 0.18, docs/SpeculativeDecoding.md): the last ngram_size - 1 tokens are looked up in the sequence so far
# and up to max_draft_tokens of the continuation are verified in one multi-token call. Set like ParaDecode's
# prompt-lookup defaults where the two compare (its shortest match, 2 tokens; 5 tokens proposed); ParaDecode
# also matches longer suffixes, takes the continuation their occurrences agree on and proposes no more than
# the match is long (runtime/lookup.py), which this library does not. K fixed (the library's default,
# min_adaptive_k 0), no chained lookup.
NGRAM_OPTIONS: dict[str, Any] = {
    "ngram_size": GenerationConfig.lookup_min_ngram + 1,
    "max_draft_tokens": GenerationConfig.lookup_tokens,
}
# OpenVINO GenAI's prompt lookup (`LLMPipeline(..., prompt_lookup=True)`, the GenerationConfig fields below): the
# sequence's last max_ngram_size tokens, then ever shorter suffixes down to one token, are looked up in the sequence
# so far; the continuation of the first occurrence found, up to num_assistant_tokens tokens, is verified in one call
# (padded to num_assistant_tokens, so every verification computes that many positions). Set like ParaDecode's
# prompt-lookup defaults where the two compare: its longest match (16 tokens) and 5 tokens proposed; ParaDecode stops
# at 2-token matches and takes the continuation their occurrences agree on (runtime/lookup.py), which this library
# does not. The library reports no count of the tokens it proposed, so its rows have no lookup counts.
OPENVINO_LOOKUP_OPTIONS: dict[str, int] = {
    "max_ngram_size": GenerationConfig.lookup_max_ngram,
    "num_assistant_tokens": GenerationConfig.lookup_tokens,
}


def default_cache() -> Path:
    from paradecode.tools.peer_models import DEFAULT_CACHE

    return DEFAULT_CACHE


@dataclass(frozen=True)
class PeerSettings:
    """Which peers the benchmark runs, and how (`paradecode-bench --peers ...`)."""

    peers: tuple[str, ...]
    precision: str = "int4"  # onnxruntime-genai's weights (its model builder's -p)
    source: str | None = None  # the model the peers run (a MODEL as paradecode-export takes); None: the export's
    cache: Path = field(default_factory=default_cache)  # where the ort-genai and openvino peers' models are kept
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # every core, as ar's default baseline
    openvino_weights: str = "int8"  # OpenVINO's weight format, one of OPENVINO_WEIGHTS
    # the Python with optimum-intel that converts for openvino; None: this one where it has it, else an environment
    # of its own made once in `cache` (peer_models.converter_environment)
    openvino_converter: Path | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown or not self.peers or len(set(self.peers)) != len(self.peers):
            raise UserInputError(
                f"peers {', '.join(self.peers) or '(none)'}: expected distinct names from {', '.join(PEERS)}"
                + (f"; not {', '.join(map(repr, unknown))}" if unknown else "")
                + "."
            )
        if self.precision not in PRECISIONS:
            raise UserInputError(f"peer precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}.")
        if self.openvino_weights not in OPENVINO_WEIGHTS:
            raise UserInputError(
                f"OpenVINO weights {self.openvino_weights!r}: expected one of {', '.join(OPENVINO_WEIGHTS)}."
            )
        if not isinstance(self.threads, int) or self.threads < 1:
            raise UserInputError(f"peer threads must be a positive integer, got {self.threads!r}.")


def missing_packages(peers: Sequence[str]) -> list[str]:
    """The distributions the given peers need that are not installed (found without importing them)."""
    missing = []
    for peer in peers:
        for module, distribution in PACKAGES[peer]:
            if importlib.util.find_spec(module) is None and distribution not in missing:
                missing.append(distribution)
    return missing


def check_peer_packages(peers: Sequence[str]) -> None:
    """Refuse before anything is loaded when a peer's package is missing, naming what to install."""
    missing = missing_packages(peers)
    if missing:
        raise MissingDependencyError(
            f"--peers {','.join(peers)} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed. Install the peers extra: `{INSTALL}` (llama-cpp-python compiles llama.cpp from "
            "source: several minutes)."
        )


@dataclass(frozen=True)
class TimedOutput:
    """A `generate` call timed: `time.perf_counter()` at its start and at each token's arrival; the peak RSS growth
    of the process that decoded it, where that is not the benchmark's own (tools/peer_process.py)."""

    output: PeerOutput
    started: float
    stamps: list[float]
    peak_rss_mb: float | None = None

    def with_peak(self, peak_rss_mb: float) -> TimedOutput:
        return replace(self, peak_rss_mb=peak_rss_mb)


@dataclass(frozen=True)
class PeerOutput:
    """What one `generate` call decoded: the new tokens (the stop token included) and speculation counts."""

    token_ids: list[int]
    proposed: int = 0  # tokens the peer's own speculation proposed (n-gram lookup)
    accepted: int = 0  # ... and verified
    rollbacks: int = 0  # verifications that rejected a proposed token (the rest of the proposal discarded)


class PeerRunner:
    """One peer's lifecycle (`load` / `generate` / `close`); subclasses write `_load`, `_tokens` (or `_decode`, for a
    library that calls back with its tokens) and `_close`.

    `generate` is the same for every peer: it checks the call, stops at an `eos_token_ids` token (kept in
    the output, as paradecode's decoding keeps it) or after `max_new_tokens`, and reports each token to
    `on_token` as it arrives (the benchmark stamps its time).
    """

    name = "peer"

    def __init__(self, *, threads: int, max_seq_len: int, eos_token_ids: Sequence[int] = ()):
        if threads < 1 or max_seq_len < 2:
            raise UserInputError(
                f"{self.name}: threads must be >= 1 and max_seq_len >= 2, got {threads}, {max_seq_len}."
            )
        self.threads = threads
        self.max_seq_len = max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._loaded = False

    def load(self) -> PeerRunner:
        if not self._loaded:
            self._load()
            self._loaded = True
        return self

    def close(self) -> None:
        if self._loaded:
            self._loaded = False
            self._close()

    def __enter__(self) -> PeerRunner:
        return self.load()

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, ids: Sequence[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None
    ) -> PeerOutput:
        self._check_loaded()
        ids = [int(i) for i in ids]
        if not ids or max_new_tokens < 1:
            raise UserInputError(
                f"{self.name}: need prompt ids and max_new_tokens >= 1, got {len(ids)} and {max_new_tokens}."
            )
        budget = min(max_new_tokens, self.max_seq_len - len(ids))  # ar stops where its cache is full, too
        if budget < 1:
            raise UserInputError(
                f"{self.name}: the prompt has {len(ids)} tokens, which fills the {self.max_seq_len} positions the "
                "export allows (its max_seq_len): give a shorter prompt."
            )
        tokens: list[int] = []
        stats: dict[str, int] = {}

        def take(token: int) -> bool:
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            return token not in self.eos_token_ids and len(tokens) < budget

        self._decode(ids, budget, stats, take)
        return PeerOutput(tokens, **stats)

    def _check_loaded(self) -> None:
        if not self._loaded:
            raise UserInputError(f"{self.name}: generate() before load() (or after close()).")

    def timed(self, ids: Sequence[int], max_new_tokens: int) -> TimedOutput:
        """`generate`, timed from its start and at each token's arrival."""
        started, stamps = time.perf_counter(), []
        output = self.generate(ids, max_new_tokens, on_token=lambda _: stamps.append(time.perf_counter()))
        return TimedOutput(output, started, stamps)

    def _load(self) -> None:
        raise NotImplementedError

    def _decode(self, ids: list[int], budget: int, stats: dict[str, int], take: Callable[[int], bool]) -> None:
        """Hand the greedy tokens after `ids` to `take` one by one as they arrive, until it answers False (the stop
        token or the budget) or the library stops; fill `stats` as `_tokens` says. By default, from `_tokens`."""
        stream = self._tokens(ids, budget, stats)
        try:
            for token in stream:
                if not take(token):
                    break
        finally:
            stream.close()

    def _tokens(self, ids: list[int], budget: int, stats: dict[str, int]) -> Iterator[int]:
        """Greedy tokens after `ids`, at least `budget` of them unless the library stops; on exit, fill `stats` with
        the speculation counts (PeerOutput's proposed, accepted and rollbacks) where the peer speculates."""
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


def import_peer(peer: str, module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"the {peer} peer needs the Python module {module} ({err}). Install the peers extra: `{INSTALL}`."
        ) from err


class OrtGenaiRunner(PeerRunner):
    """onnxruntime-genai on a folder its model builder wrote (genai_config.json, model.onnx).

    The config is overlaid so that the library's session uses `threads` intra-op threads and never stops
    by itself at an end-of-sequence token (`generate` stops at the export's, so every mode stops alike).
    `speculative`: options for `GeneratorParams.set_speculative_options` (None: plain decoding).
    """

    name = "ort-genai"

    def __init__(self, folder: Path, *, speculative: dict[str, Any] | None = None, **common):
        super().__init__(**common)
        self.folder = Path(folder)
        self.speculative = dict(speculative) if speculative else None
        self._og = self._model = None

    def _load(self) -> None:
        og = import_peer(self.name, "onnxruntime_genai")
        if not (self.folder / "genai_config.json").is_file():
            raise UserInputError(
                f"{self.folder} has no genai_config.json: it is not an onnxruntime-genai model folder."
            )
        config = og.Config(str(self.folder))
        config.clear_providers()  # the CPU
        session = {"intra_op_num_threads": self.threads}
        config.overlay(json.dumps({"model": {"eos_token_id": [], "decoder": {"session_options": session}}}))
        self._og, self._model = og, og.Model(config)

    def _tokens(self, ids: list[int], budget: int, stats: dict[str, int]) -> Iterator[int]:
        params = self._og.GeneratorParams(self._model)
        params.set_search_options(max_length=len(ids) + budget, do_sample=False)
        if self.speculative:
            params.set_speculative_options(**self.speculative)
        generator = self._og.Generator(self._model, params)
        try:
            generator.append_tokens(ids)
            while not generator.is_done():
                generator.generate_next_token()
                yield int(generator.get_next_tokens()[0])
        finally:
            if self.speculative:
                counts = generator.get_speculative_stats()
                stats["proposed"] = int(counts.get("draft_tokens_proposed", 0))
                stats["accepted"] = int(counts.get("draft_tokens_accepted", 0))
                stats["rollbacks"] = int(counts.get("partial_accept_rounds", 0)) + int(
                    counts.get("zero_accept_rounds", 0)
                )
            del generator

    def _close(self) -> None:
        self._model = self._og = None


class LlamaCppRunner(PeerRunner):
    """llama.cpp (llama-cpp-python) on a GGUF file: greedy (`temp=0`: its greedy sampler, no penalties)."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, **common):
        super().__init__(**common)
        self.gguf = Path(gguf)
        self._llama = None

    def _load(self) -> None:
        llama_cpp = import_peer(self.name, "llama_cpp")
        try:
            self._llama = llama_cpp.Llama(
                model_path=str(self.gguf),
                n_ctx=self.max_seq_len,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                n_gpu_layers=0,
                logits_all=False,
                verbose=False,
            )
        except (ValueError, RuntimeError) as err:  # llama-cpp-python reports a model it cannot load so
            raise UserInputError(f"llama.cpp could not load {self.gguf}: {err}") from err

    def _tokens(self, ids: list[int], budget: int, stats: dict[str, int]) -> Iterator[int]:
        self._llama.reset()  # no prefix of an earlier call reused: every call decodes its prompt from scratch
        yield from self._llama.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)

    def _close(self) -> None:
        llama, self._llama = self._llama, None
        if llama is not None:
            llama.close()


class OpenVinoRunner(PeerRunner):
    """OpenVINO GenAI's `LLMPipeline` on the CPU, on a folder optimum-intel wrote (openvino_model.xml).

    Its CPU plugin runs `threads` threads (INFERENCE_NUM_THREADS) and otherwise as it does by default: on a CPU with
    AVX512-BF16 or AMX, bf16 arithmetic and a KV cache quantized to u8, whose rounding can change greedy tokens (and
    make `lookup` part from plain decoding: it runs in another pipeline, with paged attention, that rounds
    differently). `properties` are more CPU plugin properties, such as the tests' `{"INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32"}` for float32 arithmetic. Each `generate` is greedy, with no end-of-sequence or stop
    token of the library's own (`generate` stops at the export's, so every mode stops alike); a streamer hands each
    token over as it arrives. `lookup`: the library's prompt lookup with OPENVINO_LOOKUP_OPTIONS instead of plain
    decoding.
    """

    name = "openvino"

    def __init__(self, folder: Path, *, lookup: bool = False, properties: dict[str, Any] | None = None, **common):
        super().__init__(**common)
        self.folder = Path(folder)
        self.lookup = lookup
        self.properties = dict(properties or {})
        self._og = self._ov = self._pipeline = None

    def _load(self) -> None:
        og = import_peer(self.name, "openvino_genai")
        if not (self.folder / "openvino_model.xml").is_file():
            raise UserInputError(
                f"{self.folder} has no openvino_model.xml: it is not a folder optimum-intel's OpenVINO exporter wrote."
            )
        properties = {**self.properties, "INFERENCE_NUM_THREADS": self.threads}
        if self.lookup:
            properties["prompt_lookup"] = True
        try:
            pipeline = og.LLMPipeline(str(self.folder), "CPU", **properties)
        except RuntimeError as err:  # OpenVINO reports a model or property it cannot take so
            raise UserInputError(f"OpenVINO GenAI could not load {self.folder}: {err}") from err
        self._og, self._ov, self._pipeline = og, import_peer(self.name, "openvino"), pipeline

    def _decode(self, ids: list[int], budget: int, stats: dict[str, int], take: Callable[[int], bool]) -> None:
        import numpy as np

        og, ov = self._og, self._ov
        config = og.GenerationConfig()  # greedy, no penalty; the model's generation_config.json is not read
        config.max_new_tokens = budget
        config.do_sample = False
        config.ignore_eos = True
        if self.lookup:
            for key, value in OPENVINO_LOOKUP_OPTIONS.items():
                setattr(config, key, value)
        prompt = np.array([ids], dtype=np.int64)
        inputs = og.TokenizedInputs(ov.Tensor(prompt), ov.Tensor(np.ones_like(prompt)))
        self._pipeline.generate(inputs, config, token_streamer(og, take))

    def _close(self) -> None:
        self._pipeline = self._og = self._ov = None


def token_streamer(og, take: Callable[[int], bool]):
    """An OpenVINO GenAI streamer that hands each token to `take` (several at once after a verified lookup) and stops
    the generation once `take` answers False."""

    class TokenStreamer(og.StreamerBase):
        def write(self, arrived):
            for token in [arrived] if isinstance(arrived, int) else arrived:
                if not take(int(token)):
                    return og.StreamingStatus.STOP
            return og.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    return TokenStreamer()


def peer_mode(name: str, runner: PeerRunner, settings: dict[str, Any]) -> Mode:
    """A harness mode that decodes with `runner`, timing every token as it arrives (as `stream_mode` does)."""

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        timed = runner.timed(prompt_ids, max_new_tokens)
        out = timed.output
        return Sample.from_stamps(
            out.token_ids,
            timed.started,
            timed.stamps,
            lookup_proposed=out.proposed,
            lookup_accepted=out.accepted,
            rollbacks=out.rollbacks,
            peak_rss_mb=timed.peak_rss_mb,
        )

    return Mode(name, "peer", run, settings)


def peer_modes(settings: PeerSettings, model, stack: ExitStack, *, ignore_eos: bool = False) -> list[Mode]:
    """The peers' modes beside `model` (a loaded export): their models prepared (onnxruntime-genai's built once
    and cached), their runners loaded and registered on `stack` to be closed with it."""
    from paradecode.tools import peer_models
    from paradecode.tools.peer_process import PeerProcess  # each peer in a process of its own: its crash is its own

    check_peer_packages(settings.peers)
    manifest = model.manifest
    source = peer_models.peer_source(settings.source, manifest)
    gguf = peer_models.gguf_file_of(source) if "llama.cpp" in settings.peers else None  # refused before a build
    converter = None
    if "openvino" in settings.peers:  # refused before a build, too
        converter = peer_models.openvino_converter(settings.openvino_converter, settings.cache)
    common = dict(
        threads=settings.threads,
        max_seq_len=manifest.max_seq_len,
        eos_token_ids=() if ignore_eos else model.export.eos_token_ids,
    )
    threads = f"{settings.threads} thread{'s' if settings.threads > 1 else ''}"
    modes = []
    if "ort-genai" in settings.peers:
        folder = peer_models.genai_model_folder(source, settings.precision, settings.cache)
        described = {"peer": "ort-genai", "precision": settings.precision, "threads": settings.threads}
        for name, speculative in (("ort-genai", None), ("ort-genai-ngram", NGRAM_OPTIONS)):
            runner = stack.enter_context(PeerProcess(OrtGenaiRunner, folder=folder, speculative=speculative, **common))
            settings_row = {**described, "model": str(folder), **({"speculative": speculative} if speculative else {})}
            modes.append(peer_mode(f"{name} {settings.precision} ({threads})", runner, settings_row))
    if gguf is not None:
        runner = stack.enter_context(PeerProcess(LlamaCppRunner, gguf=gguf, **common))
        described = {"peer": "llama.cpp", "model": str(gguf), "threads": settings.threads}
        modes.append(peer_mode(f"llama.cpp gguf ({threads})", runner, described))
    if converter is not None:
        weights = settings.openvino_weights
        folder = peer_models.openvino_model_folder(source, weights, settings.cache, converter)
        described = {"peer": "openvino", "weights": weights, "threads": settings.threads, "model": str(folder)}
        for name, lookup in (("openvino", False), ("openvino-lookup", True)):
            runner = stack.enter_context(PeerProcess(OpenVinoRunner, folder=folder, lookup=lookup, **common))
            settings_row = {**described, **({"lookup": OPENVINO_LOOKUP_OPTIONS} if lookup else {})}
            modes.append(peer_mode(f"{name} {weights} ({threads})", runner, settings_row))
    logger.info(
        "peers: %s; each uses %s (every core, as ar's default baseline does)", ", ".join(m.name for m in modes), threads
    )
    return modes
