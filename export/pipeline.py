"""`export_model`: a Hugging Face causal LM -> a validated paradecode export folder.

Order of work: every check that can refuse the request runs before anything is written (output
folder and that it can be created, TensorRT availability, model folder with its weight files and
tokenizer, family, checkpoint shapes, limits, exit layers, heads). The export is then staged in a
temporary folder beside the output and renamed into place only when every subgraph has been written
and validated, so an interrupted or failed export, or one that fills the disk, leaves nothing behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from paradecode.export import validate
from paradecode.export.config import DEFAULT_MAX_SEQ_LEN, DEFAULT_THRESHOLD, ExportConfig, default_exit_layers
from paradecode.export.draft_head import VOCAB as DRAFT_VOCAB
from paradecode.export.draft_head import check_draft_head, draft_weights, head_feature_layers, load_draft_head
from paradecode.export.families import family_for
from paradecode.export.files import (
    check_output_folder,
    export_bytes,
    file_hashes,
    package_version,
    replaceable,
    save_weights,
    staged_folder,
)
from paradecode.export.heads.file import check_heads, load_heads
from paradecode.export.onnx_export import GraphTemplate, save_onnx, stored_tensors
from paradecode.export.segments import segment_from_layers
from paradecode.export.source import ModelSource, resolve_model
from paradecode.export.tokenizer import check_chat_template, save_tokenizer
from paradecode.export.weight_storage import head_quantized, quantized_weights
from paradecode.graphs.errors import UserInputError, ValidationError
from paradecode.graphs.manifest import (
    NEVER_EXIT,
    TOKENIZER_DIR,
    WEIGHTS_NAME,
    Manifest,
    Subgraph,
    onnx_path,
)
from paradecode.graphs.modules import build_subgraph, subgraph_state
from paradecode.graphs.ops import TORCH_DTYPES, rope_caches
from paradecode.graphs.quantization_manifest import Quantization
from paradecode.graphs.quantized_weights import QuantizedWeight
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import SubgraphIO, export_plan

logger = logging.getLogger(__name__)

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@dataclass
class ExportResult:
    path: Path
    manifest: Manifest
    checklist: validate.Checklist
    seconds: float


def export_model(config: ExportConfig) -> ExportResult:
    started = time.perf_counter()
    check_output_folder(config.output, config.force)
    target = None
    if config.engine == "tensorrt":
        from paradecode.export.tensorrt import require_tensorrt

        target = require_tensorrt()
    source = resolve_model(config.model)
    check_output_is_not_source(config.output, source)
    check_chat_template(source)
    if config.weights == "auto" and source.gguf_path is not None and config.dtype != "float32":
        raise UserInputError(
            f"--weights auto keeps the GGUF file's quantized blocks, which compute in float32; for a dense "
            f"{config.dtype} export of {config.model}, pass --weights float."
        )
    family = family_for(source.config_dict().get("model_type"))
    hf_model = load_hf_model(source)
    spec = family.spec(hf_model.config, hf_model)
    max_seq_len = resolve_max_seq_len(config, spec)
    identity = source.identity()
    exit_layers, transforms, heads_metadata, vocab = resolve_exit_layers(config, spec, identity)
    draft = resolve_draft_head(config, spec, identity)
    features = () if draft is None else head_feature_layers(*draft, spec.num_layers)  # the layers it reads too
    weights = family.weights(hf_model, spec)
    if spec.positions == "rope":  # the rotary tables the exported layers read, one per inverse frequencies
        for table in spec.rope_tables:
            weights[f"{table}.cos"], weights[f"{table}.sin"] = rope_caches(
                weights[f"{table}.inv_freq"], spec.rope_scaling, max_seq_len, torch.float32
            )
    quantized = quantized_weights(config.weights, source.gguf_path, weights)
    weights.update(head_weights(spec, weights, transforms, vocab))
    quantized.update(head_quantized(quantized, weights, vocab))
    if draft is not None:  # its unembedding rows as the graphs compute with them; its own weights stay float
        name = "unembed.weight" if "unembed.weight" in weights else "embed.tokens.weight"
        weights.update(draft_weights(draft[0], quantized[name].dequantize() if name in quantized else weights[name]))
    quantization = None
    if quantized:
        quantization = Quantization(config.activations, {name: q.format for name, q in quantized.items()})
    # What the graphs compute with: the float weights, each quantized one as its blocks dequantize.
    reference = {**weights, **{name: q.dequantize() for name, q in quantized.items()}}
    plan = export_plan(
        spec,
        exit_layers,
        dtype=config.dtype,
        max_seq_len=max_seq_len,
        max_batch=config.max_batch,
        with_logits=config.with_logits,
        exit_heads=bool(transforms),
        head_vocab=None if vocab is None else len(vocab),
        fused_exits=config.fused_exits and bool(transforms),
        segments=config.segments,
        draft=draft is not None,
        feature_layers=features,
    )
    logger.info(
        "exporting %s (%s, %d layers, hidden %d) to %s: %s, max_seq_len %d, exit layers %s, %s heads",
        config.model,
        spec.family,
        spec.num_layers,
        spec.hidden_size,
        config.output,
        weights_summary(config, quantization),
        max_seq_len,
        ",".join(map(str, exit_layers)),
        "trained" if transforms else "identity",
    )

    needed = export_bytes(weights, quantized, config.dtype)
    with staged_folder(config.output, config.force, needed, may_replace=replaceable) as folder:
        tokenizer_files = save_tokenizer(source, folder / TOKENIZER_DIR)
        (folder / WEIGHTS_NAME).parent.mkdir(parents=True, exist_ok=True)
        save_weights(folder / WEIGHTS_NAME, weights, config.dtype, quantized)  # first: the graphs point into it
        checklist, onnx_files = write_subgraphs(
            folder,
            hf_model,
            spec,
            Weights(weights, reference, quantization, quantized),
            plan,
            config,
            max_seq_len,
            prompt_ids(folder, tokenizer_files, spec, identity, max_seq_len),
            features,
        )
        if checklist.failed:
            raise ValidationError(
                "the export does not reproduce the PyTorch model; nothing was written:\n"
                + "\n".join(c.line() for c in checklist.failed)
            )
        engines, tensorrt = {}, None
        if target is not None:
            from paradecode.export.tensorrt import ProfileSettings, build_engines

            settings = ProfileSettings(config.max_batch, max_seq_len, config.max_unverified)
            cache_dir = config.cache_dir or Path.home() / ".cache" / "paradecode"
            sources = onnx_files
            if quantization is not None:  # the graphs TensorRT reads (export/quantized_products_tensorrt.py)
                sources = {name: tensorrt_variant(path) for name, path in onnx_files.items()}
            engines = build_engines(folder, plan, sources, settings, target, cache_dir)
            for name, path in sources.items():
                if path != onnx_files[name]:
                    (folder / path).unlink()
            tensorrt = {"version": target.version, "gpu": target.gpu, "token_ranges": settings.token_ranges()}
        manifest = Manifest(
            model=identity,
            spec=spec,
            dtype=config.dtype,
            max_seq_len=max_seq_len,
            max_batch=config.max_batch,
            max_unverified=config.max_unverified,
            opset=config.opset,
            exit_layers=exit_layers,
            head_kind="trained" if transforms else "identity",
            thresholds=default_thresholds(exit_layers, heads_metadata, bool(transforms)),
            head_vocab=None if vocab is None else len(vocab),
            calibration=calibration_of(heads_metadata),
            draft=None if draft is None else draft_entry(*draft, features),
            subgraphs=tuple(Subgraph(io, onnx_files[io.name], engines.get(io.name)) for io in plan),
            files=file_hashes(folder),
            tokenizer=tuple(f"{TOKENIZER_DIR}/{name}" for name in tokenizer_files),
            tensorrt=tensorrt,
            quantization=quantization,
            ops=config.resolved_ops,
            paradecode_version=package_version(),
        )
        manifest.write(folder)
    seconds = time.perf_counter() - started
    return ExportResult(config.output, manifest, checklist, seconds)


# --- checks before anything is written ---------------------------------------------------------


def check_output_is_not_source(output: Path, source: ModelSource) -> None:
    out, src = output.resolve(), source.path.resolve()
    if out == src or out in src.parents:
        raise UserInputError(f"output {output} would replace the model folder {source.path}. Choose another -o path.")


def load_hf_model(source: ModelSource) -> torch.nn.Module:
    """The model in float32 and eval mode, refused when a checkpoint tensor's shape does not fit its config.

    Mismatched sizes are collected rather than raised by transformers, whose own error refers to a
    report it logs (and the CLI keeps transformers' logs quiet), so the message can name them.
    A GGUF file is loaded and checked by `gguf_file.model_from_gguf`.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if source.gguf_path is not None:
        from paradecode.export.gguf_file import model_from_gguf

        return model_from_gguf(source.gguf_path, source.reference)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(source.path), dtype=torch.float32, ignore_mismatched_sizes=True, output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise UserInputError(f"transformers could not load {source.reference}: {str(err).splitlines()[0]}") from err
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        files = ", ".join(f.name for f in source.weight_files)
        raise UserInputError(
            f"the weights in {source.path} ({files}) do not fit its config.json: "
            + "; ".join(sorted(mismatch_line(m) for m in mismatched))
            + ". The checkpoint and config.json come from different models or the checkpoint was altered: "
            "save the model again with `model.save_pretrained(folder)`."
        )
    return model.eval()


def mismatch_line(mismatch) -> str:
    """transformers reports a mismatch as (key, checkpoint shape, model shape)."""
    if isinstance(mismatch, (tuple, list)) and len(mismatch) == 3:
        key, got, expected = mismatch
        return f"{key} has shape {tuple(got)}, the config expects {tuple(expected)}"
    return str(mismatch)


def resolve_max_seq_len(config: ExportConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    if config.max_seq_len is None:
        return min(limit, spec.rope_max_positions or limit, DEFAULT_MAX_SEQ_LEN)
    if config.max_seq_len > limit:
        raise UserInputError(
            f"--max-seq-len {config.max_seq_len} exceeds the model's max_position_embeddings ({limit}, from its "
            f"config.json). Use --max-seq-len {limit} or less."
        )
    rope_limit = spec.rope_max_positions
    if rope_limit is not None and config.max_seq_len > rope_limit:
        raise UserInputError(
            f"--max-seq-len {config.max_seq_len} exceeds the {rope_limit} positions the model's rotary embedding "
            f"holds in a fixed table (its longrope scaling's original_max_position_embeddings: past it transformers "
            f"switches to the long factors for the whole sequence, which a fixed graph cannot follow). Use "
            f"--max-seq-len {rope_limit} or less."
        )
    return config.max_seq_len


def resolve_exit_layers(
    config: ExportConfig, spec: ModelSpec, identity: dict
) -> tuple[tuple[int, ...], dict, dict, torch.Tensor | None]:
    """The exit layers, the trained transforms, the heads file's metadata and reduced vocabulary (if --heads)."""
    last = spec.num_layers
    if last < 2:
        raise UserInputError(f"the model has {last} layer: there is no intermediate layer to exit at.")
    transforms: dict[int, torch.Tensor] = {}
    metadata: dict = {}
    vocab = None
    exit_layers = config.exit_layers
    if config.heads is not None:
        transforms, metadata, vocab = load_heads(config.heads)
        if vocab is not None and (int(vocab.min()) < 0 or int(vocab.max()) >= spec.vocab_size):
            raise UserInputError(
                f"--heads {config.heads}: its vocabulary holds token ids outside 0..{spec.vocab_size - 1}: "
                "it was made for another tokenizer."
            )
        exit_layers = check_heads(
            config.heads, transforms, metadata, spec=spec, model=identity, exit_layers=exit_layers
        )
        transforms = {e: transforms[e] for e in exit_layers}
    exit_layers = exit_layers or default_exit_layers(last)
    bad = [e for e in exit_layers if not 1 <= e < last]
    if bad:
        raise UserInputError(
            f"exit layers {bad} are out of range: an exit head sits after a layer 1..{last - 1}, below the last "
            f"layer ({last}), whose output the final head reads. Choose --exit-layers within 1..{last - 1}."
        )
    return tuple(exit_layers), transforms, metadata, vocab


def resolve_draft_head(
    config: ExportConfig, spec: ModelSpec, identity: dict
) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The draft head's tensors and metadata (--draft-head), checked against the model; None without one."""
    if config.draft_head is None:
        return None
    tensors, metadata = load_draft_head(config.draft_head)
    check_draft_head(config.draft_head, tensors, metadata, spec=spec, model=identity)
    return tensors, metadata


def draft_entry(tensors: dict[str, torch.Tensor], metadata: dict, feature_layers: tuple[int, ...]) -> dict:
    """The manifest's record of a draft head: its vocabulary's size, where it came from and, for one reading three
    layers' outputs, the low and middle ones."""
    entry = {
        "vocab": len(tensors[DRAFT_VOCAB]),
        "trained": bool(metadata.get("trained", False)),
        "base_weights_sha256": metadata.get("base_weights_sha256"),
    }
    if feature_layers:
        entry["feature_layers"] = list(feature_layers)
    return entry


def head_weights(
    spec: ModelSpec, weights: dict[str, torch.Tensor], transforms: dict[int, torch.Tensor], vocab: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The exit heads' canonical weights: each layer's transform, and for a reduced vocabulary its token ids
    and their rows of the unembedding (stored once, shared by every exit head)."""
    heads = {f"exits.{e}.transform": t for e, t in transforms.items()}
    if vocab is not None:
        unembed = weights.get("unembed.weight", weights["embed.tokens.weight"])
        heads["exits.vocab"] = vocab.to(torch.int64).contiguous()
        heads["exits.unembed"] = unembed[vocab].contiguous()
    return heads


def default_thresholds(exit_layers: tuple[int, ...], heads_metadata: dict, trained: bool) -> dict[int, float]:
    """The runtime's default threshold per exit layer: the calibrated ones for trained heads.

    A layer the calibration did not select gets NEVER_EXIT, and so does every layer without trained heads:
    the model's own head at an intermediate layer rarely agrees with the final one, so exiting by default
    would make decoding slower than plain decoding (docs/design.md §2). Heads without a calibration (an old or
    hand-made heads file) get DEFAULT_THRESHOLD.
    """
    if not trained:
        return dict.fromkeys(exit_layers, NEVER_EXIT)
    calibrated = (heads_metadata.get("calibration") or {}).get("thresholds")
    if calibrated is None:
        return dict.fromkeys(exit_layers, DEFAULT_THRESHOLD)
    return {e: NEVER_EXIT if calibrated.get(str(e)) is None else float(calibrated[str(e)]) for e in exit_layers}


def calibration_of(heads_metadata: dict) -> dict | None:
    if "calibration" not in heads_metadata:
        return None
    return {
        **heads_metadata["calibration"],
        "agreement": heads_metadata.get("agreement"),
        "heads_data": heads_metadata.get("data"),
    }


# --- writing ----------------------------------------------------------------------------------


def structure_key(io: SubgraphIO, spec: ModelSpec, weights: dict) -> tuple:
    """Subgraphs with equal keys have the same graph up to their weights."""
    if io.kind == "layer":
        return ("layer", spec.window(io.layer))
    if io.kind == "layer_exit":
        return ("layer_exit", spec.window(io.layer), f"exits.{io.layer}.transform" in weights, "exits.vocab" in weights)
    if io.kind in ("exit", "final"):
        return (
            "head",
            io.kind,
            io.kind == "exit" and f"exits.{io.layer}.transform" in weights,
            "exits.vocab" in weights,
        )
    return (io.kind,)


@dataclass(frozen=True)
class Weights:
    """An export's weights three ways: as the source gave them (`float`, what slicing is checked with), as the
    graphs compute with them (`reference`: each quantized weight as its blocks dequantize, the rest as given),
    and which are quantized and how (`quantization`, None for a float export; `quantized`, their blocks)."""

    float: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]
    quantization: Quantization | None
    quantized: dict[str, QuantizedWeight]


def tensorrt_variant(relative: str) -> str:
    """Where the TensorRT variant of a quantized graph is written for the engine build."""
    return relative.removesuffix(".onnx") + ".tensorrt.onnx"


def weights_summary(config: ExportConfig, quantization: Quantization | None) -> str:
    if quantization is None:
        return f"{config.dtype} weights"
    sources = ", ".join(f"{n} {kind}" for kind, n in quantization.sources().items())
    return f"quantized weights ({sources}), {quantization.activations} activations"


def write_subgraphs(
    folder: Path,
    hf_model,
    spec: ModelSpec,
    all_weights: Weights,
    plan: list[SubgraphIO],
    config: ExportConfig,
    max_seq_len: int,
    ids: list[int],
    feature_layers: tuple[int, ...] = (),
) -> tuple[validate.Checklist, dict[str, str]]:
    """Trace (or template), save and validate every subgraph (`feature_layers`: those a draft head reads beside the
    last one); return the checklist and the ONNX file names."""
    dtype = TORCH_DTYPES[config.dtype]
    weights, quantization = all_weights.reference, all_weights.quantization
    ops = config.resolved_ops
    checklist = validate.Checklist()
    fp32 = {io.name: build_subgraph(spec, io, all_weights.float, with_logits=config.with_logits) for io in plan}
    checklist.add(validate.check_slicing(hf_model, fp32, plan, spec, ids, max_seq_len=max_seq_len))
    modules = (
        fp32
        if dtype == torch.float32 and quantization is None
        else {io.name: build_subgraph(spec, io, weights, dtype=dtype, with_logits=config.with_logits) for io in plan}
    )
    real = validate.real_inputs(
        modules, plan, spec, ids, max_seq_len=max_seq_len, dtype=dtype, feature_layers=feature_layers
    )
    export_args = dict(
        vocab_size=spec.vocab_size, dtype=dtype, opset=config.opset, max_batch=config.max_batch, max_seq_len=max_seq_len
    )
    templates: dict[tuple, GraphTemplate] = {}
    files: dict[str, str] = {}
    generator = torch.Generator().manual_seed(0)
    stored = stored_tensors(folder / WEIGHTS_NAME)
    name_of = {id(tensor): name for name, tensor in weights.items()}
    layer_graphs: dict[int, onnx.ModelProto] = {}  # what segments are composed of
    layer_ios = {io.layer: io for io in plan if io.kind == "layer"}
    layer_variants: dict[int, onnx.ModelProto] = {}  # the same for TensorRT's variants (quantized exports)
    for i, io in enumerate(plan, 1):
        started = time.perf_counter()
        relative = onnx_path(io.name)
        tensorrt_variants = config.engine == "tensorrt" and quantization is not None  # built from, removed after
        if io.kind == "segment":
            model, how = segment_from_layers(io, layer_graphs), "composed"
            variant = segment_from_layers(io, layer_variants) if tensorrt_variants else None
        else:
            template, how = template_for(io, templates, spec, weights, config, generator, export_args)
            canonical = {k: name_of[id(t)] for k, t in subgraph_state(spec, io, weights, ops=ops).items()}
            model = template.instantiate(io, canonical, stored, quantization)
            variant = None
            if tensorrt_variants:
                variant = template.instantiate(io, canonical, stored, quantization, tensorrt=all_weights.quantized)
            if io.kind == "layer":
                layer_graphs[io.layer], layer_variants[io.layer] = model, variant
        save_onnx(model, folder / relative)
        files[io.name] = relative
        if variant is not None:
            save_onnx(variant, folder / tensorrt_variant(relative))
        tolerance = validate.tolerance_of(config.dtype, quantization, io.kind)
        # int8 activations round relative to the activations: random inputs on the model's own scale
        like = real[io.name] if tolerance is validate.INT8_ACTIVATIONS else None
        cases = [
            (
                f"random T={t}",
                validate.random_inputs(
                    io,
                    spec,
                    max_seq_len=max_seq_len,
                    max_batch=config.max_batch,
                    tokens=t,
                    dtype=dtype,
                    generator=generator,
                    like=like,
                ),
            )
            for t in (1, 4)
        ]
        cases += [(f"real {n}", inputs) for n, inputs in enumerate(real[io.name])]
        if io.kind == "segment":
            layers = [(folder / files[f"layer_{i}"], layer_ios[i]) for i in range(io.layer, io.last + 1)]
            check = checklist.add(validate.check_segment(folder / relative, io, layers, cases))
        else:
            check = checklist.add(validate.check_onnxruntime(folder / relative, modules[io.name], io, cases, tolerance))
        diff = check.measured or check.note
        logger.info(
            "[%2d/%d] %-14s %-13s %5.1f s  onnxruntime %s %s",
            i,
            len(plan),
            io.name,
            how,
            time.perf_counter() - started,
            check.status,
            diff,
        )
    return checklist, files


def template_for(
    io: SubgraphIO, templates: dict, spec: ModelSpec, weights: dict, config, generator, export_args: dict
) -> tuple[GraphTemplate, str]:
    """The graph template subgraph `io` is instantiated from, and how it was made: traced once per structure
    from random weights, or traced from the subgraph itself where its graph folds weights (not a template)."""
    dtype = TORCH_DTYPES[config.dtype]
    exported = dict(ops=config.resolved_ops, max_seq_len=export_args["max_seq_len"])
    key = structure_key(io, spec, weights)
    how = "from template"
    if key not in templates:
        read = {id(t) for t in subgraph_state(spec, io, weights, ops=config.resolved_ops).values()}
        traced = random_weights(weights, generator, read)
        random_module = build_subgraph(spec, io, traced, dtype=dtype, with_logits=config.with_logits, **exported)
        templates[key] = GraphTemplate.trace(random_module, io, **export_args)
        how = "traced"
    template = templates[key]
    if template.foreign:  # not a template: trace this subgraph itself; what matches its weights is shared
        own = build_subgraph(spec, io, weights, dtype=dtype, with_logits=config.with_logits, **exported)
        return GraphTemplate.trace(own, io, **export_args), "traced"
    return template, how


def random_weights(
    weights: dict[str, torch.Tensor], generator: torch.Generator, read: set[int]
) -> dict[str, torch.Tensor]:
    """The weights, those a subgraph reads (`read`: their ids) with distinct random values of the same shapes,
    for tracing a template. Only those: a 1B model's whole weights take seconds to fill, once per structure.
    float32, as the source's: `build_subgraph` casts them to the export's dtype as it does the source's."""
    return {
        k: torch.randn(v.shape, generator=generator).mul_(0.1) if id(v) in read and v.is_floating_point() else v
        for k, v in weights.items()
    }


def prompt_ids(
    folder: Path, tokenizer_files: list[str], spec: ModelSpec, identity: dict, max_seq_len: int
) -> list[int]:
    """A real prompt for validation: the model's tokenizer on a line of code, else fixed ids."""
    limit = max(1, min(16, max_seq_len - 4))
    if "tokenizer.json" in tokenizer_files:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(folder / TOKENIZER_DIR / "tokenizer.json")).encode(PROMPT).ids
        ids = [i for i in ids if 0 <= i < spec.vocab_size]
        if ids:
            return ids[:limit]
    bos = identity.get("bos_token_id")
    start = [bos] if isinstance(bos, int) and 0 <= bos < spec.vocab_size else []
    return (start + [(7 * k + 3) % spec.vocab_size for k in range(limit)])[:limit]
