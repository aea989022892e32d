"""ONNX from subgraph modules: tracing with `torch.onnx.export` (dynamo) and weight templates.

Tracing a decoder layer costs seconds, and every layer of a model has the same graph up to its
weights (and its sliding window). So each distinct structure is traced once, from a module with
random weights, and becomes a `GraphTemplate`: its initializers are matched, by value, to the
parameters they came from (as is, or transposed by the exporter's optimizer). Instantiating the
template for a layer writes that layer's weights into those initializers. Every instantiated
graph is then validated against its own PyTorch module like any other (see `validate.py`).
"""

from __future__ import annotations

import contextlib
import io as _io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, numpy_helper
from torch.export import Dim

from paradecode.graphs.errors import ValidationError
from paradecode.graphs.tensors import BATCH, POSITIONS, TOKENS, SubgraphIO

logger = logging.getLogger(__name__)

ONNX_DTYPES = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT64: torch.int64,
    TensorProto.INT32: torch.int32,
    TensorProto.BOOL: torch.bool,
}
DTYPE_NAMES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT64: "int64",
}
EXTERNAL_DATA_BYTES = 1 << 30  # graphs above 1 GiB keep their weights in a side file (protobuf's limit is 2 GiB)
SMALL_CONSTANT = 64  # unmatched float initializers up to this size are structural constants (scales, eps)


def example_inputs(io: SubgraphIO, vocab_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: batch 2 (where dynamic) and 3 tokens, so no dimension specialises to 1."""
    batch, tokens = 2, 3
    args = []
    for t in io.inputs:
        shape = t.concrete(batch, tokens)
        if t.name == POSITIONS:
            args.append((torch.arange(tokens) + 4 * torch.arange(shape[0])[:, None]).to(torch.int64))
        elif t.dtype == "int64":
            args.append(torch.randint(0, vocab_size, shape))
        else:
            args.append(torch.randn(shape, dtype=dtype) * 0.1)
    return tuple(args)


def dynamic_shapes(io: SubgraphIO, max_batch: int, max_seq_len: int) -> dict[str, dict[int, Dim]]:
    dims = {BATCH: Dim(BATCH, min=1, max=max(max_batch, 2)), TOKENS: Dim(TOKENS, min=1, max=max_seq_len)}
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
    args = example_inputs(io, vocab_size, dtype)
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


def initializer_of(name: str, tensor: torch.Tensor, data_type: int) -> TensorProto:
    tensor = tensor.detach().to(ONNX_DTYPES[data_type]).contiguous()
    proto = TensorProto(name=name, data_type=data_type, dims=list(tensor.shape))
    proto.raw_data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return proto


@dataclass
class GraphTemplate:
    """A traced graph whose weight initializers can be refilled from another module of the same structure."""

    model: onnx.ModelProto
    sources: dict[str, tuple[str, bool]]  # initializer name -> (parameter/buffer name, transposed)

    @classmethod
    def trace(cls, module: torch.nn.Module, io: SubgraphIO, **export_args) -> GraphTemplate | None:
        """Trace `module` (random weights, so every parameter's values are unique) into a template.

        Initializers that match no parameter must be structural constants, the same for every
        subgraph of this structure: integer ones (shapes, slot indices) or small float ones (scales).
        Returns None when a larger float initializer matches no parameter (it might have been folded
        from weights): the structure is then traced for every subgraph instead.
        """
        model = onnx_from_module(module, io, **export_args)
        state = {k: v.detach() for k, v in module.state_dict().items()}
        sources: dict[str, tuple[str, bool]] = {}
        for init in model.graph.initializer:
            value = tensor_of(init)
            match = _find_source(value, state)
            if match is not None:
                sources[init.name] = match
            elif value.is_floating_point() and value.numel() > SMALL_CONSTANT:
                logger.debug(
                    "%s: initializer %s (%s) has no source parameter; not templating",
                    io.name,
                    init.name,
                    tuple(value.shape),
                )
                return None
        return cls(model, sources)

    def instantiate(self, module: torch.nn.Module, io: SubgraphIO) -> onnx.ModelProto:
        state = {k: v.detach() for k, v in module.state_dict().items()}
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        for init in model.graph.initializer:
            if init.name in self.sources:
                source, transposed = self.sources[init.name]
                value = state[source].t() if transposed else state[source].reshape(tuple(init.dims))
                init.CopyFrom(initializer_of(init.name, value, init.data_type))
        model.graph.name = io.name
        check_contract(model, io)
        return model


def _find_source(value: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[str, bool] | None:
    for name, param in state.items():
        if param.dtype != value.dtype or param.numel() != value.numel() or param.numel() <= 1:
            continue
        if param.shape == value.shape and torch.equal(param, value):
            return name, False
        if param.dim() == 2 and param.t().shape == value.shape and torch.equal(param.t(), value):
            return name, True
        if param.dim() == 1 and torch.equal(param.reshape(value.shape), value):
            return name, False
    return None


def save_onnx(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write `model` to `path` (weights in `path.data` when large), check the written file with
    `onnx.checker` (by path, so external data is checked too); return the files written."""
    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=1024,
    )
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as err:
        raise ValidationError(f"{path.name}: onnx.checker rejects the exported graph: {err}") from err
    return [path, path.with_name(path.name + ".data")] if external else [path]
