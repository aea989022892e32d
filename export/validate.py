"""Validation: every exported subgraph against its PyTorch module, and the modules against transformers.

Two kinds of check, collected into a checklist that `paradecode-export` prints:

- *slicing*: the chain of fp32 subgraph modules (prefill, then token-by-token decode with the
  fixed-size caches) reproduces the Hugging Face model's logits for a real prompt;
- *onnxruntime*: each ONNX graph, run by onnxruntime, reproduces its module's outputs on random
  inputs (random caches, positions and batch) and on the real inputs that the prompt produced.

Tolerances depend on the dtype. A top-1 token may differ only at a near tie (its margin below the
tolerance); such cases are counted and reported, never hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paradecode.graphs.errors import MissingDependencyError
from paradecode.graphs.ortvalues import ort_value
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import (
    EMBEDDED,
    FEATURES,
    HIDDEN,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    MARGIN,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    PRESENT_KEY,
    PRESENT_VALUE,
    PROB,
    TOKEN,
    SubgraphIO,
    of_layer,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    # atol as a share of each output's largest magnitude (errors that scale with a tensor's largest values)
    of_max: bool = False
    # instead of elementwise bounds, the error's norm as a share of the output's: |got - ref|_2 <= l2 |ref|_2
    # (int8 activations: rounding noise spread over every element, largest where a block holds an outlier)
    l2: float | None = None

    def __str__(self) -> str:
        if self.l2 is not None:
            return f"|Δ|₂ <= {self.l2:g}·|ref|₂"
        return f"atol {self.atol:g}{'·max|ref|' if self.of_max else ''} rtol {self.rtol:g}"


TOLERANCES = {
    "float32": Tolerance(1e-4, 1e-3),
    "float16": Tolerance(2e-2, 2e-2),
    "bfloat16": Tolerance(8e-2, 5e-2),
}
# Quantized weights: the graphs are compared with PyTorch modules holding the same weights dequantized. With
# float activations they compute the same sums in another order (MatMulNBits, and minima as a separate
# product): float32 rounding, relative to the largest value (SmolLM2's residual stream reaches 2e4, where a
# float32 ulp is 2e-3). int8 activations (onnxruntime's accuracy_level 4) round each block of a MatMul's
# input to 8 bits: an error spread over the whole output, largest in a block that holds one of a model's
# outlier channels (measured on SmolLM2's layers: single elements off by up to 30% of the largest value on
# random inputs, the error's norm 4.5% of the output's at most). So int8 graphs are checked by the error's
# norm, within 10% (a wrong graph is off by the whole output); the same graphs with float activations are
# checked elementwise to 1e-5 of the largest value. A head's top-1 token may differ where its margin is
# within 2 x 10% of the largest logit.
# The exported graphs' norms, rotary embeddings and attention (over the whole cache, masked) sum in another order
# than the PyTorch modules too.
RELATIVE_FLOAT32 = Tolerance(1e-5, 1e-3, of_max=True)
INT8_ACTIVATIONS = Tolerance(1e-1, 0.0, of_max=True, l2=1e-1)


def tolerance_of(dtype: str, quantization, kind: str) -> Tolerance:
    """The tolerance a graph of this kind (graphs/tensors.py KINDS) of this export is validated with."""
    if quantization is not None and quantization.activations_of(kind) == "int8":
        return INT8_ACTIVATIONS
    if dtype == "float32":
        return RELATIVE_FLOAT32
    return TOLERANCES[dtype]


SLICING_TOLERANCE = Tolerance(1e-3, 1e-3)  # fp32 modules vs transformers (different kernels, same math)


@dataclass
class Check:
    subject: str
    what: str
    status: str  # "ok", "FAIL" or "skip"
    max_diff: float | None = None
    tolerance: Tolerance | None = None
    note: str = ""
    # what an L2 tolerance bounds: the worst output's |Δ|₂ / |ref|₂ (None for elementwise tolerances)
    l2_ratio: float | None = None

    @property
    def measured(self) -> str:
        """The error against the bound it was held to: `|Δ|₂ 0.031·|ref|₂ (<= 0.1·|ref|₂)`, or `max|Δ| 2.0e-03 (atol
        ...)`; with an L2 bound the largest single difference follows, for information."""
        if self.tolerance is not None and self.tolerance.l2 is not None and self.l2_ratio is not None:
            worst = f"; max|Δ| {self.max_diff:.1e}" if self.max_diff is not None else ""
            return f"|Δ|₂ {self.l2_ratio:.3f}·|ref|₂ ({self.tolerance}{worst})"
        diff = f"max|Δ| {self.max_diff:.1e}" if self.max_diff is not None else ""
        return f"{diff} ({self.tolerance})" if self.tolerance else diff

    def line(self) -> str:
        parts = [f"[{self.status:>4}]", f"{self.subject:<14}", f"{self.what:<34}", self.measured, self.note]
        return "  ".join(p for p in parts if p)


@dataclass
class Checklist:
    checks: list[Check] = field(default_factory=list)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        logger.debug(check.line())
        return check

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]


def compare(
    subject: str, what: str, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], tol: Tolerance
) -> Check:
    """Compare every output of `actual` with `expected`.

    A top-1 token may differ only where the expected top-1/top-2 margin (`expected[MARGIN]`) is a
    near tie, within what the tolerance allows the logits to move.
    """
    worst, worst_excess, near_ties, problems = 0.0, 0.0, 0, []
    worst_ratio: float | None = None  # of the outputs an L2 bound judges (not a head's token, margin, probability)
    for name, got in actual.items():
        want = expected[name]
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            continue
        if name == TOKEN:
            differ = got != want
            if differ.any():
                atol = (tol.l2 if tol.l2 is not None else tol.atol) * _scale(name, expected, tol)
                ties = expected[MARGIN][differ] <= 2 * atol + tol.rtol * 10
                near_ties += int(ties.sum())
                if not ties.all():
                    problems.append(f"top-1 token differs at {int((~ties).sum())} position(s) without a near tie")
            continue
        want, got = want.to(torch.float64), got.to(torch.float64)
        diff = (got - want).abs()
        finite = torch.isfinite(want)
        if not torch.equal(torch.isfinite(got), finite):
            problems.append(f"{name} has non-finite values where the reference has none (or the reverse)")
            continue
        diff = diff[finite]
        if diff.numel():
            worst = max(worst, float(diff.max()))
            if tol.l2 is not None and name in (MARGIN, PROB):
                # derived from the logits: within twice their allowed error (a probability: as a share of 1)
                scale = _scale(name, expected, tol) if name == MARGIN else 1.0
                excess = float(diff.max()) / (2 * scale) - tol.l2 + tol.atol
            elif tol.l2 is not None:
                ratio = float(diff.norm() / max(float(want[finite].norm()), 1e-12))
                worst_ratio = ratio if worst_ratio is None else max(worst_ratio, ratio)
                excess = ratio - tol.l2 + tol.atol
            else:
                excess = float((diff - tol.rtol * want[finite].abs()).max()) / _scale(name, expected, tol)
            worst_excess = max(worst_excess, excess)
    if worst_excess > tol.atol:
        problems.append("outside tolerance")
    note = "; ".join(problems)
    if near_ties:
        note = (note + "; " if note else "") + f"{near_ties} near-tie token difference(s)"
    return Check(subject, what, "FAIL" if problems else "ok", worst, tol, note, worst_ratio)


def _scale(name: str, expected: dict[str, torch.Tensor], tol: Tolerance) -> float:
    """What a tolerance's atol is a share of: 1, or (`of_max`) the largest magnitude of the reference output,
    for a head's token and margin that of its logits (their error is the logits' error)."""
    if not tol.of_max:
        return 1.0
    reference = expected[LOGITS] if name in (TOKEN, MARGIN) and LOGITS in expected else expected[name]
    finite = reference[torch.isfinite(reference)] if reference.is_floating_point() else reference
    return max(float(finite.to(torch.float64).abs().max()), 1e-12) if finite.numel() else 1.0


# --- onnxruntime ----------------------------------------------------------------------------------


def ort_session(path, threads: int = 0):
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise MissingDependencyError(
            "onnxruntime is needed to validate the exported graphs: `pip install paradecode[cpu]` "
            "(or `paradecode[gpu]` for onnxruntime-gpu)."
        ) from err
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_ort(session, io: SubgraphIO, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the graph as the runtime does: each in-place output (a layer's caches) bound to a copy of the
    buffer fed as its input, so slots the call does not write keep what they held, as in the module's cache."""
    values = {k: ort_value(v.detach().cpu().contiguous().clone()) for k, v in inputs.items()}
    binding = session.io_binding()
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for name in io.output_names:
        if name in io.in_place:
            binding.bind_ortvalue_output(name, values[io.in_place[name]])
        else:
            binding.bind_output(name)
    session.run_with_iobinding(binding)
    result = {}
    for name, value in zip(io.output_names, binding.get_outputs()):
        if value.data_type() == "tensor(bfloat16)":
            raise NotImplementedError("reading bfloat16 outputs needs a device build of onnxruntime")
        result[name] = torch.from_numpy(value.numpy().copy())
    return result


def run_torch(module: torch.nn.Module, io: SubgraphIO, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run a subgraph module on copies of `inputs` (the module writes its caches in place). A head's outputs
    come with its logits even where the graph outputs none: a tolerance may be relative to them."""
    args = [inputs[name].clone() for name in io.input_names]
    with torch.no_grad():
        out = module(*args)
        out = dict(zip(io.output_names, out if isinstance(out, tuple) else (out,)))
        if TOKEN in out and LOGITS not in out:
            if io.kind == "layer_exit":
                out[LOGITS] = module.head.logits(out[HIDDEN_OUT][:, -1:])
            elif io.kind == "draft":
                out[LOGITS] = module.head.logits(out[HIDDEN_OUT])
            else:
                out[LOGITS] = module.logits(inputs[HIDDEN])
    return out


def check_onnxruntime(path, module, io: SubgraphIO, cases: list[tuple[str, dict]], tol: Tolerance) -> Check:
    """Run the graph at `path` with onnxruntime on every case and compare with `module` within `tol`."""
    results = []
    try:
        session = ort_session(path, threads=1)
        for label, inputs in cases:
            expected, actual = run_torch(module, io, inputs), run_ort(session, io, inputs)
            results.append(compare(io.name, label, expected, actual, tol))
    except MissingDependencyError:
        raise
    except Exception as err:  # onnxruntime raises its own exception types; report what it said
        return cannot_run(io, "onnxruntime vs PyTorch", err)
    failed = [r for r in results if r.status == "FAIL"]
    worst = max(r.max_diff or 0.0 for r in results)
    ratio = max((r.l2_ratio for r in results if r.l2_ratio is not None), default=None)
    notes = "; ".join(f"{r.what}: {r.note}" for r in results if r.note)
    kinds = [label.split()[0] for label, _ in cases]
    what = f"onnxruntime vs PyTorch, {kinds.count('random')} random + {kinds.count('real')} real"
    return Check(io.name, what, "FAIL" if failed else "ok", worst, tol, notes, ratio)


def check_segment(path, io: SubgraphIO, layers: list[tuple[Path, SubgraphIO]], cases: list[tuple[str, dict]]) -> Check:
    """A composed segment against the chain of its own layer graphs (each validated against PyTorch): the same
    kernels on the same inputs, so they agree to float32 rounding whatever the activations' precision."""
    tol = RELATIVE_FLOAT32
    try:
        results = compare_segment(path, io, layers, cases, tol)
    except MissingDependencyError:
        raise
    except Exception as err:  # onnxruntime raises its own exception types; report what it said
        return cannot_run(io, "vs its layer graphs", err)
    failed = [r for r in results if r.status == "FAIL"]
    notes = "; ".join(f"{r.what}: {r.note}" for r in results if r.note)
    kinds = [label.split()[0] for label, _ in cases]
    what = f"vs its layer graphs, {kinds.count('random')} random + {kinds.count('real')} real"
    return Check(io.name, what, "FAIL" if failed else "ok", max(r.max_diff or 0.0 for r in results), tol, notes)


def compare_segment(path, io: SubgraphIO, layers: list[tuple[Path, SubgraphIO]], cases: list[tuple[str, dict]], tol):
    """The segment graph's outputs against its layer graphs' chained outputs, per case."""
    segment = ort_session(path, threads=1)
    sessions = [(ort_session(layer_path, threads=1), layer_io) for layer_path, layer_io in layers]
    results = []
    for label, inputs in cases:
        expected: dict[str, torch.Tensor] = {}
        hidden = inputs[HIDDEN]
        for session, layer_io in sessions:
            feeds = {HIDDEN: hidden, POSITIONS: inputs[POSITIONS]}
            feeds[PAST_KEY] = inputs[of_layer(PAST_KEY, layer_io.layer)]
            feeds[PAST_VALUE] = inputs[of_layer(PAST_VALUE, layer_io.layer)]
            out = run_ort(session, layer_io, feeds)
            hidden = out[HIDDEN_OUT]
            expected[of_layer(PRESENT_KEY, layer_io.layer)] = out[PRESENT_KEY]
            expected[of_layer(PRESENT_VALUE, layer_io.layer)] = out[PRESENT_VALUE]
        expected[HIDDEN_OUT] = hidden
        results.append(compare(io.name, label, expected, run_ort(segment, io, inputs), tol))
    return results


def cannot_run(io: SubgraphIO, what: str, err: Exception) -> Check:
    """A skipped check where onnxruntime's CPU provider lacks a kernel for the graph's dtype (bfloat16 and
    float16 MatMuls); any other error is raised."""
    if "NOT_IMPLEMENTED" not in str(err) and not isinstance(err, NotImplementedError):
        raise err
    dtype = io.inputs[0].dtype if io.kind != "embed" else io.outputs[0].dtype
    return Check(
        io.name,
        what,
        "skip",
        note=(
            f"onnxruntime's CPU provider cannot run {dtype} graphs ({str(err).splitlines()[0][-60:]}); "
            "validate on a GPU (onnxruntime-gpu or --engine tensorrt)"
        ),
    )


# --- inputs ---------------------------------------------------------------------------------------


def random_inputs(
    io: SubgraphIO,
    spec: ModelSpec,
    *,
    max_seq_len: int,
    max_batch: int,
    tokens: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    like: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Random inputs: hidden states, full random caches (masked slots must not matter), random positions; two rows
    at positions of their own where the export batches (graphs/tensors.py), else one. A call of one token reads a
    cache of max_seq_len slots, a longer one a cache of the slots its positions need (a multiple of 8): any number
    up to max_seq_len is the contract's.

    Standard normal values, or with `like` (the graph's inputs in each call on a real prompt) normal values on the
    scale of the model's own activations: each channel's (a cache's: each head's) root mean square over those calls
    (`channel_scale`). A graph whose products round their inputs to 8 bits errs relative to the values it adds to a
    residual stream; N(0, 1) hidden states are far smaller than a real model's, so the sublayers' rounding (which
    a sandwich norm rescales to full size) stood out as an error of 30% or more that the same graph never makes on
    the model's own activations (Gemma 3 270M's layers at --max-seq-len 512)."""
    batch = min(2, max_batch)
    tokens = min(tokens, max_seq_len)
    starts = torch.randint(0, max_seq_len - tokens + 1, (batch,), generator=generator)
    slots = max_seq_len if tokens == 1 else min(max_seq_len, -(-(int(starts.max()) + tokens) // 8) * 8)
    inputs = {}
    for t in io.inputs:
        shape = t.concrete(batch, tokens, slots)
        if t.name == POSITIONS:
            inputs[t.name] = starts[:, None] + torch.arange(tokens)
        elif t.name == INPUT_IDS:
            inputs[t.name] = torch.randint(0, spec.vocab_size, shape, generator=generator)
        else:
            values = torch.randn(shape, generator=generator)
            if like:
                values = values * channel_scale([call[t.name] for call in like], cache=len(shape) == 4)
            inputs[t.name] = values.to(dtype)
    return inputs


def channel_scale(real: list[torch.Tensor], *, cache: bool) -> torch.Tensor:
    """The root mean square of each channel of the tensors `real` (one input over several calls; a channel: the last
    dimension, or for caches [B, H, S, D] each head's, [1, H, 1, D]) over the rows they hold (a cache's unwritten
    slots, all zero, left out), broadcastable to their shape; 1 where nothing was written."""
    if cache:  # [H, D, rows]
        rows = torch.cat([t.detach().to(torch.float64).permute(1, 3, 0, 2).flatten(2) for t in real], dim=2)
        rows = rows[:, :, rows.abs().sum(dim=(0, 1)) > 0]
        rms = rows.pow(2).mean(-1).sqrt() if rows.shape[2] else torch.ones(rows.shape[:2], dtype=torch.float64)
        return rms.clamp_min(1e-6).to(torch.float32)[None, :, None, :]
    rows = torch.cat([t.detach().to(torch.float64).reshape(-1, t.shape[-1]) for t in real])  # [rows, channels]
    rows = rows[rows.abs().sum(-1) > 0]
    rms = rows.pow(2).mean(0).sqrt() if rows.shape[0] else torch.ones(rows.shape[1], dtype=torch.float64)
    return rms.clamp_min(1e-6).to(torch.float32)


def real_inputs(
    modules: dict[str, torch.nn.Module],
    plan: list[SubgraphIO],
    spec: ModelSpec,
    ids: list[int],
    *,
    max_seq_len: int,
    dtype: torch.dtype,
    decode_steps: int = 2,
    feature_layers: tuple[int, ...] = (),
) -> dict[str, list[dict]]:
    """Run the module chain on a real prompt (prefill, then greedy decode) and record each call's inputs
    (`feature_layers`: the layers whose outputs a draft head's map reads beside the last one's)."""
    cache_shape = (1, spec.num_kv_heads, max_seq_len, spec.head_dim)
    caches = {
        io.layer: (torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype))
        for io in plan
        if io.kind == "layer"
    }
    draft_cache = (torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype))
    recorded: dict[str, list[dict]] = {io.name: [] for io in plan}
    chunk, start = torch.tensor([ids]), 0
    token = None  # the final head's newest token: a draft head's call reads it (the plan runs `final` before it)
    with torch.no_grad():
        for _ in range(decode_steps + 1):
            positions = torch.arange(start, start + chunk.shape[1])[None]
            hidden, outputs = None, {}  # outputs: of the feature layers
            for io in plan:
                if io.kind == "layer_exit":  # fed what layer e was fed, before it wrote its cache
                    recorded[io.name].append({k: v.clone() for k, v in recorded[f"layer_{io.layer}"][-1].items()})
                    continue
                if io.kind == "segment":  # fed what its layers were fed: assembled below
                    continue
                if io.kind == "embed":
                    inputs = {INPUT_IDS: chunk, POSITIONS: positions}
                elif io.kind == "layer":
                    inputs = {
                        HIDDEN: hidden,
                        POSITIONS: positions,
                        PAST_KEY: caches[io.layer][0],
                        PAST_VALUE: caches[io.layer][1],
                    }
                elif io.kind == "draft":  # after the final head: each position's output beside the token after it
                    following, shifted = torch.cat([chunk[:, 1:], token], dim=1), positions + 1
                    embedded = modules["embed"](*([following, shifted] if len(plan[0].inputs) == 2 else [following]))
                    inputs = {
                        HIDDEN: hidden,
                        EMBEDDED: embedded,
                        POSITIONS: shifted,
                        PAST_KEY: draft_cache[0],
                        PAST_VALUE: draft_cache[1],
                    }
                elif io.kind == "draft_reduce":
                    inputs = {FEATURES: torch.cat([*(outputs[f] for f in feature_layers), hidden], dim=-1)}
                else:
                    inputs = {HIDDEN: hidden}
                inputs = {k: v for k, v in inputs.items() if k in io.input_names}
                recorded[io.name].append({k: v.clone() for k, v in inputs.items()})
                out = modules[io.name](*[inputs[k] for k in io.input_names])
                if io.kind in ("embed", "layer"):
                    hidden = out if io.kind == "embed" else out[0]
                    if io.kind == "layer" and io.layer in feature_layers:
                        outputs[io.layer] = hidden
                elif io.kind == "final":
                    token = out[0][:, -1:]
            start += chunk.shape[1]
            chunk = token
    for io in plan:
        if io.kind == "segment":
            recorded[io.name] = [segment_inputs(io, recorded, step) for step in range(decode_steps + 1)]
    return recorded


def segment_inputs(io: SubgraphIO, recorded: dict[str, list[dict]], step: int) -> dict[str, torch.Tensor]:
    """A segment's inputs at `step`: its first layer's hidden state and positions, each layer's caches as that
    layer was fed them (the caches as they were before the step wrote them)."""
    first = recorded[f"layer_{io.layer}"][step]
    inputs = {HIDDEN: first[HIDDEN].clone(), POSITIONS: first[POSITIONS].clone()}
    for layer in range(io.layer, io.last + 1):
        fed = recorded[f"layer_{layer}"][step]
        inputs[of_layer(PAST_KEY, layer)] = fed[PAST_KEY].clone()
        inputs[of_layer(PAST_VALUE, layer)] = fed[PAST_VALUE].clone()
    return inputs


def check_slicing(
    hf_model,
    modules: dict[str, torch.nn.Module],
    plan: list[SubgraphIO],
    spec: ModelSpec,
    ids: list[int],
    *,
    max_seq_len: int,
) -> Check:
    """fp32 modules chained over fixed-size caches (prefill, then one token at a time) vs transformers."""
    split = max(1, len(ids) // 2)
    cache_shape = (1, spec.num_kv_heads, max_seq_len, spec.head_dim)
    caches = {io.layer: (torch.zeros(cache_shape), torch.zeros(cache_shape)) for io in plan if io.kind == "layer"}
    pieces = []
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float()
        chunks = [(0, ids[:split])] + [(p, [ids[p]]) for p in range(split, len(ids))]
        for start, chunk in chunks:
            positions = torch.arange(start, start + len(chunk))[None]
            x = torch.tensor([chunk])
            hidden = modules["embed"](x, positions) if spec.positions == "learned" else modules["embed"](x)
            for io in plan:
                if io.kind == "layer":
                    hidden = modules[io.name](hidden, positions, *caches[io.layer])[0]
            pieces.append(modules["final"].logits(hidden)[0].float())
    ours = torch.cat(pieces)
    top = reference.topk(2, dim=-1).values
    check = compare(
        "model",
        f"slicing vs transformers ({len(ids)} tokens)",
        {"logits": reference, TOKEN: reference.argmax(-1), MARGIN: top[:, 0] - top[:, 1]},
        {"logits": ours, TOKEN: ours.argmax(-1)},
        SLICING_TOLERANCE,
    )
    return check
