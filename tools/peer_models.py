"""The models the benchmark's peers run, made from the export's own source and cached.

- onnxruntime-genai runs what its model builder writes (`python -m onnxruntime_genai.models.builder -i DIR
  -o OUT -p int4|fp32 -e cpu`) from a Hugging Face folder: the source folder itself, or, for a GGUF file, a
  float folder written from the model transformers dequantizes. A GGUF-loaded model refuses
  `save_pretrained` (docs/design.md §8), so its weights go into a fresh model of the same config without the
  `quantization_config`. (The builder reads float GGUF files only, not quantized ones.) Each build is kept
  under the cache folder, one per source weights, builder version and precision:
  `CACHE/<weights sha256>/ort-genai-<version>/<precision>/`, with `build.json` saying how it was made; it is
  staged beside its place and renamed into it only when the build succeeded.
- OpenVINO GenAI runs what optimum-intel's exporter writes (`optimum-cli export openvino --task
  text-generation-with-past --weight-format ...`, `OPENVINO_WEIGHT_OPTIONS`) from the same Hugging Face folder.
  optimum-intel 2.2 requires transformers < 5.6, so it may live in another environment than this one: the
  exporter runs as `PYTHON -m optimum.commands.optimum_cli` with the Python that has it (`--openvino-converter`;
  by default this one). Each conversion is kept as the builds are, one per source weights, converter versions and
  weight format: `CACHE/<weights sha256>/openvino-<version>-optimum-intel-<version>/<weights>/`, with
  `conversion.json` saying how it was made, staged and renamed into place the same way.
- llama.cpp runs the GGUF file itself.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from paradecode.export.source import ModelSource
from paradecode.graphs.errors import MissingDependencyError, UnsupportedModelError, UserInputError

logger = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "paradecode" / "peers"
BUILDER = "onnxruntime_genai.models.builder"
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: the builder saves it
LOG_TAIL_LINES = 12  # of the builder's log, in the error when it fails

OPENVINO_EXPORTER = "optimum.commands.optimum_cli"  # optimum-cli's module: `PYTHON -m ... export openvino`
OPENVINO_TASK = "text-generation-with-past"  # a stateful decoder with its KV cache, as OpenVINO GenAI runs it
# optimum-intel's weight compression (NNCF) for each --openvino-weights. int8: its default, asymmetric with one scale
# per output channel. int4: asymmetric in groups of 32, as `paradecode-export --weights int4` stores its blocks, every
# matrix but the embedding and the last one (NNCF keeps those int8); a matrix whose rows do not divide into groups of
# 32 gets the largest group size that does (at least 32), else int8. fp32: no compression, to check against
# transformers.
OPENVINO_WEIGHT_OPTIONS: dict[str, tuple[str, ...]] = {
    "int8": ("--weight-format", "int8"),
    "int4": ("--weight-format", "int4", "--group-size", "32", "--ratio", "1.0", "--group-size-fallback", "adjust"),
    "fp32": ("--weight-format", "fp32"),
}
CONVERTER_PACKAGES = ("optimum-intel", "optimum", "openvino", "nncf", "transformers", "torch")  # recorded
OPENVINO_INSTALL = (  # optimum-intel 2.2 requires transformers < 5.6, so it often cannot join paradecode's environment
    "optimum-intel 2.2 requires transformers < 5.6: install it in an environment of its own (`python -m venv DIR && "
    "DIR/bin/pip install 'optimum-intel[openvino]'`) and pass --openvino-converter DIR/bin/python, "
    "or, where this environment's transformers is older than 5.6, here (`pip install 'optimum-intel[openvino]'`)"
)


def peer_source(reference: str | None, manifest) -> ModelSource:
    """The model the peers run: `reference` (--peer-source), else the export's recorded source where it is on
    this machine (a folder, a .gguf file or a known short name); warns when it is not the export's model."""
    from paradecode.export.known_models import KNOWN_MODELS
    from paradecode.export.source import resolve_model

    recorded = manifest.model.get("source")
    if reference is None:
        if not recorded or not (recorded in KNOWN_MODELS or Path(recorded).exists()):
            raise UserInputError(
                f"the export was made from {recorded!r}, which is not on this machine (a folder, a .gguf file or a "
                "known short name): the peers need the original model. Pass --peer-source MODEL with a local copy."
            )
        reference = recorded
    source = resolve_model(reference)
    ours, theirs = source.identity()["weights_sha256"], manifest.model.get("weights_sha256")
    if ours != theirs:
        logger.warning(
            "--peer-source %s is not the model this export was made from (weights sha256 %s..., the export's "
            "%s...): the peer rows compare another model",
            reference,
            ours[:12],
            str(theirs)[:12],
        )
    return source


def gguf_file_of(source: ModelSource) -> Path:
    """The GGUF file llama.cpp runs, refused where the source is a folder."""
    if source.gguf_path is None:
        raise UnsupportedModelError(
            f"llama.cpp runs GGUF files, and the peers' source {source.reference} is a Hugging Face folder. Pass "
            "--peer-source FILE.gguf (the same model converted with llama.cpp's convert_hf_to_gguf.py), or leave "
            "llama.cpp out of --peers."
        )
    return source.gguf_path


def hf_folder_of(source: ModelSource, scratch: Path, peer: str) -> Path:
    """The Hugging Face folder a peer's converter reads: the source's own, or a float folder written in `scratch`
    from a GGUF file."""
    if source.gguf_path is None:
        return source.path
    folder = scratch / "float-model"
    write_float_folder(source, folder, peer=peer)
    return folder


def run_logged(command: list[str], log: Path, *, append: bool = False) -> tuple[int, str]:
    """Run `command` with its output in `log` (after what it holds, with `append`); its exit code and the log's last
    lines."""
    with open(log, "a" if append else "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    return code, "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def genai_version() -> str:
    return metadata.version("onnxruntime-genai")


def genai_model_folder(source: ModelSource, precision: str, cache: Path) -> Path:
    """onnxruntime-genai's model of `source` at `precision` for the CPU: from the cache, or built into it."""
    weights = source.identity()["weights_sha256"]
    version = genai_version()
    folder = Path(cache).expanduser() / weights / f"ort-genai-{version}" / precision
    if (folder / "genai_config.json").is_file():
        logger.info("onnxruntime-genai %s model of %s: %s (cached)", precision, source.reference, folder)
        return folder
    build_genai_model(source, precision, folder, weights=weights, version=version)
    return folder


def build_genai_model(source: ModelSource, precision: str, folder: Path, *, weights: str, version: str) -> None:
    """Run onnxruntime-genai's model builder on `source` into `folder` (staged, renamed into place at the end)."""
    from paradecode.export.files import staged_folder

    if source.gguf_path is None and not any((source.path / name).is_file() for name in TOKENIZER_NAMES):
        raise UnsupportedModelError(
            f"onnxruntime-genai's model builder needs the model's tokenizer, and {source.path} has none "
            f"({', '.join(TOKENIZER_NAMES)}). Save it there (`tokenizer.save_pretrained(folder)`), or leave "
            "ort-genai out of --peers."
        )
    log = folder.with_name(f"{precision}.build.log")  # kept beside the model, so a failed build leaves its log
    started = time.perf_counter()
    logger.info(
        "onnxruntime-genai %s: building the %s model of %s with its model builder (once; cached in %s; log %s)",
        version,
        precision,
        source.reference,
        folder,
        log,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (
        staged_folder(folder, force=True) as staged,
        tempfile.TemporaryDirectory(prefix=".build-", dir=folder.parent) as scratch,
    ):
        scratch = Path(scratch)
        hf_folder = hf_folder_of(source, scratch, "ort-genai")
        command = [sys.executable, "-m", BUILDER, "-i", str(hf_folder), "-o", str(staged), "-p", precision]
        command += ["-e", "cpu", "-c", str(scratch / "builder-cache")]
        code, tail = run_logged(command, log)
        if code != 0 or not (staged / "genai_config.json").is_file():
            raise UnsupportedModelError(
                f"onnxruntime-genai's model builder could not build the {precision} CPU model of {source.reference} "
                f"(exit code {code}; the whole log is {log}). Its last lines:\n{tail}\nLeave ort-genai out of "
                "--peers for this model."
            )
        record = {
            "source": source.reference,
            "weights_sha256": weights,
            "precision": precision,
            "onnxruntime_genai": version,
            "float_folder_from_gguf": source.gguf_path is not None,
            "command": [Path(command[0]).name, *command[1:]],
            "seconds": round(time.perf_counter() - started, 1),
        }
        (staged / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("built %s in %.0f s", folder, time.perf_counter() - started)


# The converter's versions, printed as JSON by the converter's own Python (no package imported, so it takes a moment).
VERSIONS_SCRIPT = (
    "import json, sys\n"
    "from importlib import metadata\n"
    "found = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        found[name] = metadata.version(name)\n"
    "    except metadata.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps(found))\n"
)


@dataclass(frozen=True)
class OpenVinoConverter:
    """A Python that has optimum-intel, which converts models for the openvino peer, and its packages' versions."""

    python: Path
    versions: dict[str, str]  # distribution name -> version, for those of CONVERTER_PACKAGES it has

    @property
    def key(self) -> str:
        """The cache folder its conversions are kept under: a new converter version converts again."""
        return f"openvino-{self.versions['openvino']}-optimum-intel-{self.versions['optimum-intel']}"


# The converter's own environment, made under the peer cache on first use where none is named and this Python has no
# optimum-intel: what optimum-intel 2.2 converts with, pinned as tested (2026-12-07), each group one pip call; torch's
# CPU build first, and optimum-intel without its dependencies, so that its torchvision requirement pulls no CUDA torch
# (converting a text model does not need torchvision). About 1.6 GB installed.
CONVERTER_ENVIRONMENT = "openvino-converter-optimum-intel-2.2.0"
CONVERTER_REQUIREMENTS: tuple[tuple[str, ...], ...] = (
    ("torch==2.13.0",),
    (
        "transformers<5.6",
        "huggingface-hub<1.22",
        "optimum==2.3.0",
        "nncf==3.4.0",
        "openvino==2026.4.1",
        "openvino-tokenizers==2026.4.1.0",
        "requests>=2.33",
        "setuptools",
        "sentencepiece",
        "protobuf",
    ),
    ("--no-deps", "optimum-intel==2.2.0"),
)
READY = "ready.json"  # written last in a converter environment: one without it was left unfinished


def converter_environment(cache: Path) -> Path:
    """The Python of the converter environment under `cache`: made there on first use (a venv with
    CONVERTER_REQUIREMENTS; minutes and a download of about 1 GB), and made again where an earlier attempt left it
    unfinished."""
    import shutil

    folder = Path(cache).expanduser() / CONVERTER_ENVIRONMENT
    python = folder / "bin" / "python"
    if (folder / READY).is_file():
        return python
    shutil.rmtree(folder, ignore_errors=True)  # unfinished: no READY
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.with_name(f"{CONVERTER_ENVIRONMENT}.log")
    logger.info(
        "openvino peer: making the environment its converter (optimum-intel) runs in, once: %s (minutes, about 1.6 GB; "
        "log %s)",
        folder,
        log,
    )
    started = time.perf_counter()
    steps = [[sys.executable, "-m", "venv", str(folder)]]
    steps += [[str(python), "-m", "pip", "install", "-q", *group] for group in CONVERTER_REQUIREMENTS]
    log.write_text("")
    for step in steps:
        code, tail = run_logged(step, log, append=True)
        if code != 0:
            raise UserInputError(
                f"making the openvino peer's converter environment failed: `{' '.join(step)}` exited with code {code}; "
                f"the end of its output ({log}):\n{tail}\nName a Python that has optimum-intel with "
                f"--openvino-converter PYTHON instead ({OPENVINO_INSTALL})."
            )
    (folder / READY).write_text(json.dumps({"requirements": CONVERTER_REQUIREMENTS}) + "\n")
    logger.info("openvino peer: its converter environment is ready (%.0f s)", time.perf_counter() - started)
    return python


def openvino_converter(python: Path | str | None = None, cache: Path | None = None) -> OpenVinoConverter:
    """The converter `python` (--openvino-converter), refused where it is not a Python that runs or has no
    optimum-intel. None: this Python where it has optimum-intel, else (given the peer `cache`) the converter
    environment there, made on first use (`converter_environment`)."""
    if python is None and cache is not None:
        try:
            return openvino_converter(sys.executable)
        except MissingDependencyError:
            return openvino_converter(converter_environment(cache))
    python = Path(python) if python is not None else Path(sys.executable)
    given = f"this Python ({python})" if python == Path(sys.executable) else f"--openvino-converter {python}"
    try:
        answer = subprocess.run(
            [str(python), "-c", VERSIONS_SCRIPT, *CONVERTER_PACKAGES],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UserInputError(
            f"{given}: expected a Python interpreter that has optimum-intel, and it could not be run ({err}). "
            f"{OPENVINO_INSTALL}."
        ) from err
    try:
        versions = json.loads(answer.stdout) if answer.returncode == 0 else None
    except json.JSONDecodeError:
        versions = None
    if not isinstance(versions, dict):
        raise UserInputError(
            f"{given}: expected a Python interpreter that has optimum-intel, and `{python} -c ...` exited with code "
            f"{answer.returncode} ({(answer.stderr or answer.stdout).strip()[-300:]!r}). {OPENVINO_INSTALL}."
        )
    missing = [name for name in ("optimum-intel", "openvino", "nncf") if name not in versions]
    if missing:
        raise MissingDependencyError(
            f"the openvino peer converts models with optimum-intel, and {given} lacks "
            f"{', '.join(missing)}. {OPENVINO_INSTALL}."
        )
    return OpenVinoConverter(python, {str(k): str(v) for k, v in versions.items()})


def openvino_model_folder(source: ModelSource, weights: str, cache: Path, converter: OpenVinoConverter) -> Path:
    """OpenVINO's model of `source` with `weights` compressed as OPENVINO_WEIGHT_OPTIONS says: from the cache, or
    converted into it by `converter`."""
    if weights not in OPENVINO_WEIGHT_OPTIONS:
        raise UserInputError(f"OpenVINO weights {weights!r}: expected one of {', '.join(OPENVINO_WEIGHT_OPTIONS)}.")
    sha = source.identity()["weights_sha256"]
    folder = Path(cache).expanduser() / sha / converter.key / weights
    if (folder / "conversion.json").is_file():  # written last, in the staged folder: there only when complete
        logger.info("OpenVINO %s model of %s: %s (cached)", weights, source.reference, folder)
        return folder
    convert_openvino_model(source, weights, folder, converter, weights_sha256=sha)
    return folder


def convert_openvino_model(
    source: ModelSource, weights: str, folder: Path, converter: OpenVinoConverter, *, weights_sha256: str
) -> None:
    """Run optimum-intel's exporter on `source` into `folder` (staged beside it, renamed into place at the end).

    The tokenizer is not converted: the benchmark hands OpenVINO GenAI token ids, never text."""
    from paradecode.export.files import staged_folder

    log = folder.with_name(f"{weights}.convert.log")  # beside the model, so a failed conversion leaves its log
    started = time.perf_counter()
    logger.info(
        "optimum-intel %s: converting %s to OpenVINO with %s weights (once; cached in %s; log %s)",
        converter.versions["optimum-intel"],
        source.reference,
        weights,
        folder,
        log,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (
        staged_folder(folder, force=True) as staged,
        tempfile.TemporaryDirectory(prefix=".convert-", dir=folder.parent) as scratch,
    ):
        hf_folder = hf_folder_of(source, Path(scratch), "openvino")
        command = [str(converter.python), "-m", OPENVINO_EXPORTER, "export", "openvino", "--model", str(hf_folder)]
        command += ["--task", OPENVINO_TASK, *OPENVINO_WEIGHT_OPTIONS[weights], "--disable-convert-tokenizer"]
        code, tail = run_logged([*command, str(staged)], log)
        if code != 0 or not (staged / "openvino_model.xml").is_file():
            raise UnsupportedModelError(
                f"optimum-intel could not convert {source.reference} to OpenVINO with {weights} weights (exit code "
                f"{code}; the whole log is {log}). Its last lines:\n{tail}\nLeave openvino out of --peers for this "
                "model."
            )
        record = {
            "source": source.reference,
            "weights_sha256": weights_sha256,
            "weights": weights,
            "converter": converter.versions,
            "float_folder_from_gguf": source.gguf_path is not None,
            "command": [Path(command[0]).name, *command[1:], "OUT"],
            "seconds": round(time.perf_counter() - started, 1),
        }
        (staged / "conversion.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("converted %s in %.0f s", folder, time.perf_counter() - started)


def write_float_folder(source: ModelSource, folder: Path, *, peer: str = "ort-genai") -> None:
    """A Hugging Face folder (float32 weights, config, tokenizer) of the model transformers reads from a GGUF file,
    for `peer`'s converter (named in the error when the tokenizer is missing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.tokenizer import hf_tokenizer

    logger.info("writing a float32 Hugging Face folder of %s for the %s peer's converter", source.reference, peer)
    tokenizer = hf_tokenizer(source)
    if tokenizer is None:
        raise UnsupportedModelError(
            f"the {peer} peer's converter needs the model's tokenizer, and transformers builds none from "
            f"{source.reference}. Leave {peer} out of --peers for this model."
        )
    loaded = load_hf_model(source)  # dequantized to float32, every tensor checked
    values = loaded.config.to_dict()
    values.pop("quantization_config", None)  # what makes save_pretrained refuse a GGUF-loaded model
    config = type(loaded.config).from_dict(values)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
