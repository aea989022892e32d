"""ONNX from subgraph modules: tracing with `torch.onnx.export` (dynamo) and weight templates.

Tracing a decoder layer costs seconds, and every layer of a model has the same graph up to its
weights (and its sliding window). So each distinct structure is traced once, from a module with
random weights, and becomes a `GraphTemplate`: its initializers are matched, by value, to the
parameters they came from (as is, or transposed by the exporter's optimizer). Instantiating the
template for a layer points those initializers at that layer's weights in the export's one weights
file (ONNX external data): every weight is stored once on disk, however many graphs read it, and
onnxruntime maps it from there. Every instantiated graph is then validated against its own PyTorch
module like any other (see `validate.py`).
"""

from __future__ import annotations

import contextlib
import io as _io
import json
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, numpy_helper
from torch.export import Dim

from paradecode.export import quantized_products
from paradecode.export.attention import expand_attention
from paradecode.graphs.errors import ValidationError
from paradecode.graphs.ops import ATTENTION_DOMAIN
from paradecode.graphs.quantization_manifest import Quantization
from paradecode.graphs.quantized_weights import QuantizedWeight
from paradecode.graphs.tensors import BATCH, POSITIONS, SLOTS, TOKENS, SubgraphIO

logger = logging.getLogger(__name__)

ONNX_DTYPES = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT64: torch.int64,
    TensorProto.INT32: torch.int32,
    TensorProto.BOOL: torch.bool,
}
ONNX_ITEMSIZE = {code: dtype.itemsize for code, dtype in ONNX_DTYPES.items()}
DTYPE_NAMES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT64: "int64",
}
# safetensors' dtype codes as ONNX element types (the stored parts of quantized weights included).
ONNX_TYPES = {
    "F32": TensorProto.FLOAT,
    "F16": TensorProto.FLOAT16,
    "BF16": TensorProto.BFLOAT16,
    "I64": TensorProto.INT64,
    "U8": TensorProto.UINT8,
}
SMALL_CONSTANT = 64  # unmatched float initializers up to this size are structural constants (scales, eps)


def example_inputs(io: SubgraphIO, vocab_size: int, dtype: torch.dtype, max_seq_len: int) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: batch 2 (where dynamic), 3 tokens and caches of max_seq_len slots, so no dimension
    specialises to 1."""
    batch, tokens = 2, 3
    args = []
    for t in io.inputs:
        shape = t.concrete(batch, tokens, max_seq_len)
        if t.name == POSITIONS:
            args.append((torch.arange(tokens) + 4 * torch.arange(shape[0])[:, None]).to(torch.int64))
        elif t.dtype == "int64":
            args.append(torch.randint(0, vocab_size, shape))
        else:
            args.append(torch.randn(shape, dtype=dtype) * 0.1)
    return tuple(args)


def dynamic_shapes(io: SubgraphIO, max_batch: int, max_seq_len: int) -> dict[str, dict[int, Dim]]:
    dims = {
        BATCH: Dim(BATCH, min=1, max=max(max_batch, 2)),
        TOKENS: Dim(TOKENS, min=1, max=max_seq_len),
        SLOTS: Dim(SLOTS, min=1, max=max(max_seq_len, 2)),
    }
    return {t.name: {i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)} for t in io.inputs}


def onnx_from_module(
    module: torch.nn.Module,
    io: SubgraphIO,
    *,
    vocab_size: int,
    dtype: torch.dtype,
    opset: int,
    max_batch: int,
    max_seq_len: int,
) -> onnx.ModelProto:
    """Trace `module` with the dynamo exporter; the result's inputs and outputs follow `io` exactly."""
    args = example_inputs(io, vocab_size, dtype, max_seq_len)
    chatter = _io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(chatter):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            input_names=io.input_names,
            output_names=io.output_names,
            dynamic_shapes=dynamic_shapes(io, max_batch, max_seq_len),
            opset_version=opset,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    logger.debug("torch.onnx.export of %s said: %s", io.name, chatter.getvalue())
    model = program.model_proto
    if expand_attention(model.graph):  # the attention placeholders become standard operators (export/attention.py)
        kept = [o for o in model.opset_import if o.domain != ATTENTION_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    check_contract(model, io)
    return model


def check_contract(model: onnx.ModelProto, io: SubgraphIO) -> None:
    """Fail unless the graph's inputs and outputs have exactly the names, shapes and dtypes of `io`."""
    for kind, actual, expected in (("input", model.graph.input, io.inputs), ("output", model.graph.output, io.outputs)):
        got = {v.name: v for v in actual}
        want = {t.name: t for t in expected}
        if set(got) != set(want):
            raise ValidationError(
                f"{io.name}: exported {kind}s are {sorted(got)}; the contract expects {sorted(want)} "
                f"(missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))})."
            )
        for name, spec in want.items():
            tensor_type = got[name].type.tensor_type
            shape = tuple(d.dim_param or d.dim_value for d in tensor_type.shape.dim)
            dtype = DTYPE_NAMES.get(tensor_type.elem_type, str(tensor_type.elem_type))
            if shape != spec.shape or dtype != spec.dtype:
                raise ValidationError(
                    f"{io.name}: {kind} {name!r} was exported as {dtype}{list(shape)}; "
                    f"the contract expects {spec.dtype}{list(spec.shape)}."
                )


def tensor_of(init: TensorProto) -> torch.Tensor:
    if init.data_location == TensorProto.EXTERNAL:
        raise ValueError("templates are built in memory; external initializers are not expected here")
    if init.raw_data and init.data_type in ONNX_DTYPES:
        flat = torch.frombuffer(bytearray(init.raw_data), dtype=ONNX_DTYPES[init.data_type])
        return flat.reshape(tuple(init.dims))
    return torch.from_numpy(numpy_helper.to_array(init).copy())


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in the export's weights file (a safetensors file)."""

    location: str  # the file's name, relative to the folder of the graphs that read it
    offset: int  # of the tensor's first byte in the file
    length: int  # bytes
    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype code: "F32", "F16", "U8", ...


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file with its byte range, from the file's header."""
    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_bytes))
    start = 8 + header_bytes
    return {
        name: StoredTensor(
            path.name,
            start + info["data_offsets"][0],
            info["data_offsets"][1] - info["data_offsets"][0],
            tuple(info["shape"]),
            info["dtype"],
        )
        for name, info in header.items()
        if name != "__metadata__"
    }


def external_initializer(name: str, data_type: int, dims, stored: StoredTensor) -> TensorProto:
    proto = TensorProto(name=name, data_type=data_type, dims=list(dims))
    proto.data_location = TensorProto.EXTERNAL
    for key, value in (("location", stored.location), ("offset", str(stored.offset)), ("length", str(stored.length))):
        entry = proto.external_data.add()
        entry.key, entry.value = key, value
    return proto


@dataclass
class GraphTemplate:
    """A traced graph whose weight initializers are matched to the module parameters they came from.

    `sources` maps an initializer to its parameter (or buffer) and whether the exporter transposed it; its
    dtype may differ from the parameter's where the exporter folded a cast of it (see `_find_source`).
    `foreign` lists float initializers larger than SMALL_CONSTANT that match no parameter (folded from
    weights, say): a graph with such initializers cannot serve other subgraphs as a template.
    """

    model: onnx.ModelProto
    sources: dict[str, tuple[str, bool]]  # initializer name -> (parameter/buffer name, transposed)
    foreign: list[str]

    @classmethod
    def trace(cls, module: torch.nn.Module, io: SubgraphIO, **export_args) -> GraphTemplate:
        """Trace `module` and match its initializers to its parameters by value.

        Traced from random weights, every parameter's values are unique, so the match is exact and
        the template serves every subgraph of the same structure. Initializers that match no parameter
        must be structural constants, the same for every subgraph of the structure: integer ones
        (shapes, slot indices) or small float ones (scales).
        """
        model = onnx_from_module(module, io, **export_args)
        state = {k: v.detach() for k, v in module.state_dict().items()}
        sources: dict[str, tuple[str, bool]] = {}
        foreign = []
        for init in model.graph.initializer:
            value = tensor_of(init)
            match = _find_source(value, state)
            if match is not None:
                sources[init.name] = match
            elif value.is_floating_point() and value.numel() > SMALL_CONSTANT:
                logger.debug("%s: initializer %s (%s) has no source parameter", io.name, init.name, tuple(value.shape))
                foreign.append(init.name)
        return cls(model, sources, foreign)

    def instantiate(
        self,
        io: SubgraphIO,
        canonical: dict[str, str],
        stored: dict[str, StoredTensor],
        quantization: Quantization | None = None,
        tensorrt: Mapping[str, QuantizedWeight] | None = None,
    ) -> onnx.ModelProto:
        """This graph for subgraph `io`, its weights read from the weights file.

        `canonical` maps the module's parameter names to the canonical weight names (`graphs.modules`),
        `stored` says where each canonical weight lies in the weights file. Every matched initializer
        becomes an external reference into that file (one copy of each weight on disk, whichever graphs
        read it); one the exporter had transposed reads the stored layout through a Transpose node, and one
        the exporter had cast (a float32 rotary table in a bfloat16 graph) reads the stored dtype through a
        Cast node; onnxruntime folds both when it loads the graph. The readers of a weight that `quantization`
        lists are rewritten to read its quantized parts (export/quantized_products.py), or, given the quantized
        weights as `tensorrt`, to the form TensorRT builds from (export/quantized_products_tensorrt.py).
        """
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        graph = model.graph
        graph.name = io.name
        formats = quantization.weights if quantization is not None else {}
        kept, conversions, readers = [], [], {}
        for init in graph.initializer:
            if init.name not in self.sources:
                kept.append(init)
                continue
            source, transposed = self.sources[init.name]
            if canonical[source] in formats:
                readers[init.name] = (canonical[source], transposed, formats[canonical[source]])
                continue
            weight = stored[canonical[source]]
            stored_type = ONNX_TYPES[weight.dtype]
            numel = int(torch.tensor(list(init.dims)).prod()) if init.dims else 1
            if stored_type not in ONNX_ITEMSIZE or weight.length != numel * ONNX_ITEMSIZE[stored_type]:
                raise ValidationError(
                    f"{io.name}: initializer {init.name} ({numel} values) does not fit the stored weight "
                    f"{canonical[source]} ({weight.length} bytes of {weight.dtype})."
                )
            if not transposed and stored_type == init.data_type:
                kept.append(external_initializer(init.name, init.data_type, init.dims, weight))
                continue
            stored_name = f"{init.name}__stored"
            kept.append(
                external_initializer(stored_name, stored_type, weight.shape if transposed else init.dims, weight)
            )
            value = stored_name  # the stored tensor -> what the graph reads: Cast where the dtypes differ, Transpose
            if stored_type != init.data_type:
                cast = f"{init.name}__cast" if transposed else init.name
                conversions.append(onnx.helper.make_node("Cast", [value], [cast], to=init.data_type))
                value = cast
            if transposed:
                conversions.append(onnx.helper.make_node("Transpose", [value], [init.name], perm=[1, 0]))
        del graph.initializer[:]
        graph.initializer.extend(kept)
        nodes = conversions + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
        if readers:

            def part(name: str) -> TensorProto:
                return external_initializer(name, ONNX_TYPES[stored[name].dtype], stored[name].shape, stored[name])

            quantized_products.rewrite(graph, readers, part, quantization.activations_of(io.kind), tensorrt)
            if not any(o.domain == quantized_products.MS_DOMAIN for o in model.opset_import):
                model.opset_import.append(onnx.helper.make_opsetid(quantized_products.MS_DOMAIN, 1))
        check_contract(model, io)
        return model


def _find_source(value: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[str, bool] | None:
    """The parameter `value` holds, and whether transposed. A parameter of another floating dtype matches
    where it cast to `value`'s dtype equals it: the exporter folds casts of constants (a float32 rotary table
    cast to a bfloat16 graph's dtype), and `instantiate` casts the stored tensor as the folded graph did."""
    for name, param in state.items():
        if param.numel() != value.numel() or param.numel() <= 1:
            continue
        if param.dtype != value.dtype:
            if not (param.is_floating_point() and value.is_floating_point()):
                continue
            param = param.to(value.dtype)
        if param.shape == value.shape and torch.equal(param, value):
            return name, False
        if param.dim() == 2 and param.t().shape == value.shape and torch.equal(param.t(), value):
            return name, True
        if param.dim() == 1 and torch.equal(param.reshape(value.shape), value):
            return name, False
    return None


def save_onnx(model: onnx.ModelProto, path: Path) -> Path:
    """Write `model` to `path` and check the written file with `onnx.checker` (by path, so its external
    data references are checked too). Its weights are references into the weights file, not copies."""
    onnx.save_model(model, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as err:
        raise ValidationError(f"{path.name}: onnx.checker rejects the exported graph: {err}") from err
    return path
