"""Row exactness: whether a position's results are the same bits whatever its call holds, on this machine.

ParaDecode's output equals plain decoding's token for token only as far as a position computed in a call of several
positions (a verification) gives the bits it gets in a call of its own (plain decoding's), and a batch's request
equals the request alone only as far as a row among other sequences' rows gets its own bits. That is a property of
the kernels *and of the machine*: matrix kernels choose their code path by instruction set and by row count
(onnxruntime's `MatMulNBits` with int8 activations computes a lone row otherwise than several on AVX2 without
AVX-512 and alike on AVX-512 VNNI; with float activations otherwise on both; torch's CPU products agree only between
row counts that are multiples of 4: docs/design.md §9, tools/results/cpu-2core/row-exactness.md).

So the runtime does not assume. The first time an export is loaded on a machine, `probe` computes the same positions
of a fixed prompt in calls of 1 to 17 positions through the segments, and of 1 and 3 through the per-layer and fused
exit graphs (the calls decoding makes: one position, verifications of up to K + 1, a long one), under each candidate
`RowForm`, cheapest first for the export (`candidates`), and keeps the first under which every size gives every
position's layers and final head the same bits; then, under that form, the same positions as one row of a batch of
two sequences in a cache of every slot (`_Positions.batches_agree`): where they differ, a batch's sequences run in
calls of their own (`RowForm.rows_alone`). A form pads a call with copies of each sequence's last position at the
positions after it, whose outputs are dropped (`DecodeContext.rows`), so the call's rows are at least `minimum`, a
multiple of `multiple`; or, `alone`, every position after a prompt's prefill in a call of its own (exact wherever a
lone row is computed alike, at the cost of verifications that share no call: `candidates` says where it comes
first). A copy writes later positions' cache slots, which those positions write again before any query reads them
(a position's layer runs only after every earlier position's, and a query sees slots up to its own); the cache keeps
spare slots for copies after its last position (`KVCache.spare`). Plain decoding runs in the same form, since it
must compute each position as ParaDecode's verifications do.

Where no candidate holds (`None`), ParaDecode cannot verify several positions in one call exactly, so a ParaDecode
request decodes as plain decoding does, and says so once: never silently inexact.

The verdict is cached per machine and export (`$XDG_CACHE_HOME/paradecode/row-exactness.json`, keyed by the
manifest's content, the backend and its threads, its kernels (`Backend.kernels_identity`) and the CPU's model and
flags), so a later load does not probe again. The probe runs for the onnxruntime backend on a CPU, the CPU engine,
and for the torch backend wherever torch's int4 kernels read some of its weights (`Backend.probes_rows`;
runtime/backends/int4_kernels.py: compiled on a GPU, they were seen to give a position other bits in a call of
several). Elsewhere on CUDA the form is `AS_IS`, what the GPU tests check (ParaDecode equals plain decoding in every
overlap, tests/runtime/test_gpu.py). The torch backend on a CPU (the PyTorch reference) is `AS_IS` too without int4
kernels, and there ParaDecode's output is plain decoding's up to near ties of the final head's logits, the decoding
contract's general form (its eager attention sums over the keys up to a call's highest position, so no padding
makes its rows alike).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from paradecode.graphs.cache_dir import user_cache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowForm:
    """How a call is made so that a position's bits do not depend on the call: padded to at least `minimum` rows, a
    multiple of `multiple` (rows: a call's positions over all its sequences, what the matrix kernels see); or,
    `alone`, each position of a sequence in a call of its own (a prompt's prefill aside). `rows_alone`: the
    sequences of a batch (runtime/engine.py) each in calls of their own, where a call of several sequences computes
    otherwise than one sequence's under this form."""

    minimum: int = 1
    multiple: int = 1
    alone: bool = False  # every position in a call of its own (a prompt's prefill aside: plain decoding shares it)
    rows_alone: bool = False  # a batch's sequences in calls of their own

    def __post_init__(self) -> None:
        if self.minimum < 1 or self.multiple < 1 or (self.alone and (self.minimum, self.multiple) != (1, 1)):
            raise ValueError(f"a row form pads to at least 1 row, a multiple of 1 or more, or splits; got {self}")
        if self.alone and not self.rows_alone:
            raise ValueError(f"a form whose positions run alone runs a batch's sequences alone too; got {self}")

    def rows(self, tokens: int) -> int:
        """The rows a call of `tokens` positions of one sequence runs as (a call of its own each: one)."""
        if self.alone:
            return 1
        return self.tokens_per_row(1, tokens)

    def tokens_per_row(self, batch: int, tokens: int) -> int:
        """Positions per sequence in a call of `batch` sequences of `tokens` positions each, padded so that the call's
        rows (`batch` times as many) are at least `minimum`, a multiple of `multiple`."""
        padded = max(tokens, -(-self.minimum // batch))
        while (batch * padded) % self.multiple:
            padded += 1
        return padded

    @property
    def spare(self) -> int:
        """Cache slots a call ending at the cache's last position needs after it for its copies."""
        return max(self.minimum, self.multiple) - 1

    @property
    def name(self) -> str:
        base = "alone" if self.alone else f"{self.minimum}x{self.multiple}"
        return base + ("-rows-alone" if self.rows_alone and not self.alone else "")

    def describe(self) -> str:
        batches = (
            "; a batch's sequences in calls of their own (several sequences in one call compute otherwise here)"
            if self.rows_alone and not self.alone
            else ""
        )
        if self.minimum == self.multiple == 1 and not self.alone:
            return "calls run as they come: a position's results are the same bits alone and among others" + batches
        if self.alone:
            return (
                "every position after a prompt's prefill runs in a call of its own (this machine's kernels compute a "
                "lone position otherwise than several, and padding it costs plain decoding more): exact, but "
                "ParaDecode's verifications gain nothing from sharing a call"
            )
        padding = [f"at least {self.minimum} rows"] * (self.minimum > 1) + [f"a multiple of {self.multiple} rows"] * (
            self.multiple > 1
        )
        return (
            f"calls run as {' and '.join(padding)} (copies of their last position), so that a position's results "
            "are the same bits alone and among others (this machine's kernels compute some row counts otherwise)"
            + batches
        )


AS_IS = RowForm()
TWO_ROWS = RowForm(minimum=2)
ALONE = RowForm(alone=True, rows_alone=True)
CANDIDATES = (AS_IS, TWO_ROWS, RowForm(multiple=2), RowForm(multiple=4), RowForm(multiple=8), ALONE)


def candidates(backend) -> tuple[RowForm, ...]:
    """The forms to try, cheapest first for this export. With float activations in quantized layers a call of two
    positions costs nearly twice one (onnxruntime's float kernel dequantizes the whole matrix for several rows), so a
    position alone comes before any padding there (runtime/policy.py's "every position alone" row has the
    measurement). Elsewhere padding is cheap (the int8 kernel's second row costs little) and keeps ParaDecode's
    verifications in one call."""
    quantization = backend.manifest.quantization
    if backend.name == "onnxruntime" and quantization is not None and quantization.activations_of("layer") == "float":
        return (AS_IS, ALONE, *(form for form in CANDIDATES if form not in (AS_IS, ALONE)))
    return CANDIDATES


NONE_NAME = "none"
# Call sizes compared: one position, verifications of up to K + 1 positions (lookup and exits, K 5 by default, up to
# BOUND_TOKENS in a call of the bound sessions) and one more (a call of more: another session, more threads).
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 17)
OTHER_GRAPHS_SIZES = (1, 3)  # the per-layer and fused exit graphs, compared at these sizes
PREFIX = 64  # positions before the compared ones (at most), in one call: a prompt's prefill
ROOM = max(form.spare for form in CANDIDATES) + 1  # slots after a call: the widest padding
BATCH_SIZES = (1, 3)  # positions per sequence in the batched calls compared (a batch of plain decoding, of ParaDecode)
BATCH_OFFSET = 5  # the other sequence of a compared batch is this many positions ahead
PROBE_VERSION = 5  # in the verdict's key: what the probe compares changed, so verdicts are probed again
CACHE_FILE = "row-exactness.json"
CACHE_LIMIT = 256  # verdicts kept in the cache file (the oldest go first)
CACHE_BYTES = 1 << 20  # a cache file larger than this is not read (256 verdicts take about 25 kB)


def cache_path() -> Path:
    """Where verdicts are kept: `$XDG_CACHE_HOME/paradecode/row-exactness.json` (~/.cache by default)."""
    return user_cache(CACHE_FILE)


def machine_identity() -> str:
    """The CPU's model name and feature flags (what onnxruntime's kernel dispatch reads), and the architecture. The
    features as this process's CPUID reports them (numpy's dispatch table), which an emulator or a virtual machine
    may mask below what /proc/cpuinfo lists, and /proc/cpuinfo's too."""
    fields: dict = {}
    try:
        from numpy._core._multiarray_umath import __cpu_features__  # numpy's own probe of CPUID (np.show_runtime)

        fields["cpuid"] = sorted(name for name, present in __cpu_features__.items() if present)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part") and key not in fields:
                    fields[key] = " ".join(sorted(value.split())) if key in ("flags", "Features") else value.strip()
                if not line.strip() and fields:
                    break  # the first processor's block is enough
    except OSError:
        fields["processor"] = platform.processor()
    return json.dumps([platform.machine(), fields], sort_keys=True)


def kernels_version() -> str:
    """onnxruntime's version and build, whichever package installed it (onnxruntime, onnxruntime-gpu, ...)."""
    try:
        import onnxruntime
    except ImportError:
        return "-"
    build = getattr(onnxruntime, "get_build_info", lambda: "")()
    return f"{onnxruntime.__version__} {build}"


def verdict_key(backend) -> str:
    """What a verdict depends on: the export (its manifest lists every file's hash), the backend, its threads, its
    kernels (`Backend.kernels_identity`: onnxruntime's version and build; torch's, its device, compilation, CUDA
    graphs and which weights int4 kernels read) and the machine."""
    manifest = json.dumps(backend.manifest.to_dict(), sort_keys=True).encode()  # it lists every file's hash
    parts = [
        str(PROBE_VERSION),
        hashlib.sha256(manifest).hexdigest(),
        backend.name,
        json.dumps(getattr(backend, "threads", None)),
        backend.kernels_identity(),
        machine_identity(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


FORMS_BY_NAME = {form.name: form for base in CANDIDATES for form in (base, replace(base, rows_alone=True))}


def _read_cache(path: Path) -> dict[str, str]:
    """The verdicts recorded in `path` (key -> form name or NONE_NAME); unreadable entries are left out, and a file
    that is not a verdicts file (or too large to be one) counts as none, said once."""
    try:
        if path.stat().st_size > CACHE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, more than {CACHE_BYTES}")
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        _say_unreadable(str(path), str(err).splitlines()[0][:200])
        return {}  # probed again, and the file written anew
    return {k: v for k, v in data.items() if isinstance(k, str) and (v in FORMS_BY_NAME or v == NONE_NAME)}


@functools.cache
def _say_unreadable(path: str, why: str) -> None:  # once per process and file
    logger.warning("the row-exactness verdicts in %s cannot be read (%s): probing again, writing it anew", path, why)


def _write_cache(path: Path, verdicts: dict[str, str]) -> None:
    """Write the verdicts atomically (a temporary file of its own renamed over the old one); a cache that cannot be
    written only costs a probe at the next load. Two processes writing at once keep one's verdicts: the other's
    export probes again at its next load."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(dict(list(verdicts.items())[-CACHE_LIMIT:]), f, indent=0)
        os.replace(temporary, path)
        temporary = None
    except OSError as err:
        logger.info("could not record the row-exactness verdict in %s (%s); the next load probes again", path, err)
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def row_form(backend) -> RowForm | None:
    """The form under which `backend` computes every position alike on this machine (None: none does): from the
    cache of verdicts, else probed and recorded there."""
    if not backend.probes_rows:
        if backend.device.type != "cpu":
            return AS_IS
        logger.info(
            "%s: the %s backend on a CPU is not probed for row exactness: ParaDecode's output is plain decoding's up "
            "to near ties of the final head's logits there (the onnxruntime backend's is bit for bit)",
            backend.export.path.name,
            backend.name,
        )
        return AS_IS
    path = cache_path()
    key = verdict_key(backend)
    verdicts = _read_cache(path)
    if key in verdicts:
        form = FORMS_BY_NAME.get(verdicts[key])
    else:
        form = probe(backend)
        verdicts[key] = form.name if form is not None else NONE_NAME
        _write_cache(path, verdicts)
    if form is not None and said_once((backend.export.path.name, form.name)):  # None: a request's notice says so
        logger.info("%s on this machine: %s", backend.export.path.name, form.describe())
    return form


_said: set[tuple] = set()  # (export, form) described so far in this process
_said_lock = threading.Lock()


def said_once(what: tuple) -> bool:
    """True the first time this process asks about `what`: a demo or a bench loads one export several times, and
    its verdict is told once."""
    with _said_lock:
        first = what not in _said
        _said.add(what)
        return first


def probe(backend) -> RowForm | None:
    """The first of `candidates(backend)` under which a fixed prompt's positions get the same bits (their last hidden
    state and the final head's token, probability and margin) in calls of every size in SIZES through the segments
    decoding uses, and of OTHER_GRAPHS_SIZES through the per-layer graphs and the fused exit graphs, after a prefill
    of up to PREFIX positions; None if none does, or if the cache is too small to tell (a verification needs two
    positions and the slots after them)."""
    positions = _Positions.of(backend)
    if positions is None:
        return None
    before = backend.open_subgraphs()  # with what a prefill opened: what plain decoding runs
    try:
        for form in candidates(backend):
            reference = positions.results(form, 1, "segments")
            if positions.agree(form, reference, reference_included=True):
                if form.rows_alone or positions.batches_agree(form, reference):
                    return form
                return replace(form, rows_alone=True)
        return None
    finally:  # the per-layer and fused exit graphs the probe opened: decoding opens them again where it uses them
        kinds = ("layer", "layer_exit")
        backend.close_subgraphs({n for n in backend.open_subgraphs() - before if backend.subgraphs[n].io.kind in kinds})


def shares_exactly(backend, threads: int) -> bool:
    """Whether calls on `threads` threads, fewer than the backend's (its calls while lanes compute at once:
    `Backend.sharing`), give the bits its calls on all of them give, under its row form: every compared position's
    last hidden state and final head's outputs, through each path the overlaps use (segments and fused exit graphs on
    lane 0, per-layer graphs on the side lanes), in calls of the sizes `probe` compares on each path, against plain
    decoding's calls of one position on every thread. onnxruntime's CPU kernels split their work by output, never by
    a summed dimension, as far as we know; this checks it on the machine, once per export and thread count (cached as
    the row forms are). The sessions of `threads` it opens are the ones the overlaps then use."""
    form = backend.row_form
    if form is None:  # no exact form: ParaDecode decodes as plain decoding, and nothing should run on a share
        return False
    key = hashlib.sha256(f"{verdict_key(backend)}\nshare of {threads} threads".encode()).hexdigest()
    path = cache_path()
    verdicts = _read_cache(path)
    if verdicts.get(key) not in (form.name, NONE_NAME):  # not checked yet, or under another form
        with backend.calls_on(backend.threads):  # the prompt's prefill and plain decoding's calls
            positions = _Positions.of(backend)
            exact = positions is not None
            reference = positions.results(form, 1, "segments") if exact else None
        if exact:
            with backend.calls_on(threads):
                exact = positions.agree(form, reference, reference_included=False)
        verdicts[key] = form.name if exact else NONE_NAME
        _write_cache(path, verdicts)
    exact = verdicts[key] == form.name
    logger.info(
        "%s on this machine: calls on %d of %d threads %s",
        backend.export.path.name,
        threads,
        backend.threads,
        "give every position the same bits"
        if exact
        else "give positions other bits: lanes computing at once each take every thread",
    )
    return exact


class _Positions:
    """The positions a probe compares: a fixed prompt's, after a prefill of up to PREFIX in one call, in a KV cache of
    its own; `results` computes them in calls of a size, through a path (`paths`: what decoding runs)."""

    @classmethod
    def of(cls, backend) -> _Positions | None:
        """None if the export's cache is too small to tell (a verification needs two positions and the slots after
        them)."""
        slots = backend.manifest.max_seq_len
        positions = min(max(SIZES), slots - ROOM - 1)  # compared, after a prefix of at least one
        if positions < 2:
            logger.warning("%s: a cache of %d slots is too small to probe", backend.export.path.name, slots)
            return None
        return cls(backend, positions, min(PREFIX, slots - ROOM - positions))

    def __init__(self, backend, positions: int, prefix: int):
        from paradecode.runtime.decoding import MAIN, DecodeContext  # it imports this module
        from paradecode.runtime.kvcache import KVCache
        from paradecode.runtime.tracing import Timeline

        spec, manifest = backend.spec, backend.manifest
        self.backend, self.positions, self.prefix = backend, positions, prefix
        self.sizes = [size for size in SIZES if size <= positions]
        ids = torch.randint(0, spec.vocab_size, (prefix + positions,), generator=torch.Generator().manual_seed(0))
        self.ids = ids.tolist()
        shape = (1, spec.num_kv_heads, manifest.max_seq_len, spec.head_dim)
        self.cache = KVCache(spec.num_layers, shape, backend.dtype, backend.device, grows=backend.grows_cache)
        self.timeline = Timeline(record_spans=False)
        self.fused_exits = sorted(sub.io.layer for sub in manifest.subgraphs if sub.io.kind == "layer_exit")
        # segments: what plain decoding and the main lane run; layer graphs: what side lanes, and ranges no segment
        # covers, run; exit graphs: a frontier that exits at every fused exit layer
        self.paths = ["segments", "layer graphs"] + (["exit graphs"] if self.fused_exits else [])
        self._context, self._main = DecodeContext, MAIN
        prefill = DecodeContext(backend, self.cache, self.timeline, form=AS_IS)  # slots 0..prefix-1, read by all
        prefill.layers(MAIN, 1, spec.num_layers, prefill.embed(MAIN, self.ids[:prefix], 0), 0)

    def _through(self, ctx, path: str, hidden: torch.Tensor, first: int) -> torch.Tensor:
        main, layers = self._main, self.backend.spec.num_layers
        if path == "segments":
            return ctx.layers(main, 1, layers, hidden, first)
        if path == "layer graphs":
            for layer in range(1, layers + 1):
                hidden = ctx.layer(main, layer, hidden, first)
            return hidden
        done = 0
        for layer in self.fused_exits:
            if layer - 1 > done:
                hidden = ctx.layers(main, done + 1, layer - 1, hidden, first)
            hidden, _ = ctx.layer_exit(main, layer, hidden, first)
            done = layer
        return ctx.layers(main, done + 1, layers, hidden, first) if done < layers else hidden

    def agree(self, form: RowForm, reference: tuple[torch.Tensor, list], *, reference_included: bool) -> bool:
        """Whether every path, in calls of each size compared on it (the segments at every size in SIZES, the other
        paths at OTHER_GRAPHS_SIZES), gives `reference`'s bits, the first difference ending the comparison;
        `reference_included`: `reference` is these calls' own one-position segments, not computed again."""
        return all(
            _same(reference, self.results(form, size, path))
            for path, size in self.compared()
            if not (reference_included and path == "segments" and size == 1)
        )

    def batches_agree(self, form: RowForm, reference: tuple[torch.Tensor, list]) -> bool:
        """Whether the compared positions, computed as the first row of a batch of two sequences (BATCH_SIZES
        positions a row a call, the other row BATCH_OFFSET positions ahead) in a cache holding every slot, give
        `reference`'s bits: what a batch of requests (runtime/engine.py) computes. An export that batches no
        requests (max_batch 1) has nothing to compare."""
        from paradecode.runtime.decoding import DecodeContext, RowsContext
        from paradecode.runtime.kvcache import KVCache

        backend, spec, main = self.backend, self.backend.spec, self._main
        if backend.manifest.max_batch < 2:
            return True
        other = torch.randint(
            0, spec.vocab_size, (len(self.ids) + BATCH_OFFSET,), generator=torch.Generator().manual_seed(1)
        )
        rows = [self.ids, other.tolist()]
        shape = (2, spec.num_kv_heads, backend.manifest.max_seq_len, spec.head_dim)
        cache = KVCache(spec.num_layers, shape, backend.dtype, backend.device, grows=backend.grows_cache)
        cache.reserve(shape[2])  # a position's bits must not depend on how many slots the cache holds either
        for row, length in ((0, self.prefix), (1, self.prefix + BATCH_OFFSET)):
            prefill = DecodeContext(backend, cache.rows(row, row + 1), self.timeline, form=AS_IS)
            prefill.layers(main, 1, spec.num_layers, prefill.embed(main, rows[row][:length], 0), 0)
        ctx = RowsContext(backend, cache, self.timeline, form=form)
        end = self.prefix + self.positions
        for size in BATCH_SIZES:
            hidden, heads = [], []
            for first in range(self.prefix, end, size):
                n = min(size, end - first)
                starts = [first, first + BATCH_OFFSET]
                ctx.begin(starts)
                ids = [rows[row][start : start + n] for row, start in enumerate(starts)]
                out = ctx.layers(main, 1, spec.num_layers, ctx.embed_rows(ids), first)
                head = ctx.head(main, "final", out, first)
                hidden.append(out[:1].clone())
                heads += list(zip(head.token, head.prob, head.margin))[:n]  # row 0's positions come first
            if not _same(reference, (torch.cat(hidden, 1), heads)):
                return False
        return True

    def compared(self) -> list[tuple[str, int]]:
        """(path, call size) for every comparison: the segments at every size in SIZES, other paths at
        OTHER_GRAPHS_SIZES."""
        return [(p, size) for p in self.paths for size in (self.sizes if p == "segments" else OTHER_GRAPHS_SIZES)]

    def results(self, form: RowForm, size: int, path: str) -> tuple[torch.Tensor, list]:
        """The compared positions in calls of `size` (padded as `form` says) through `path`."""
        ctx = self._context(self.backend, self.cache, self.timeline, form=form)
        hidden, heads = [], []
        end = self.prefix + self.positions
        for first in range(self.prefix, end, size):
            ids = self.ids[first : min(first + size, end)]
            out = self._through(ctx, path, ctx.embed(self._main, ids, first), first).clone()
            head = ctx.head(self._main, "final", out, first)
            hidden.append(out)
            heads += zip(head.token, head.prob, head.margin)
        return torch.cat(hidden, 1), heads


def _same(a: tuple[torch.Tensor, list], b: tuple[torch.Tensor, list]) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]
