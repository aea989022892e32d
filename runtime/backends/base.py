"""The interface every backend implements: one generic subgraph call driven by the contract.

A backend runs the export's subgraphs by name: `run(name, feeds, lane, outputs) -> outputs`, where
`feeds` holds every input of the subgraph's contract (`graphs.tensors`) by name and the result the
outputs asked for by name (Polygraphy's `infer(feed_dict)`, TensorRT-LLM's `Session.run(inputs,
outputs, stream)`). `run` is written once, here, as a template method (Polygraphy's `infer` /
`infer_impl`); each backend writes only its launch:

1. check: the subgraph is the export's and the feeds are its inputs by name and dtype (cheap: a
   set comparison and one dtype per feed; the detailed message is built only when one fails);
2. feeds to the device (a no-op on a CPU, where they already are);
3. `_launch(name, feeds, lane)`: the backend runs the subgraph and returns the outputs it produced
   (every output but the in-place ones) and whether they are buffers it reuses on its next call;
4. outputs: the ones asked for (all where `outputs` is None; names the subgraph lacks are skipped),
   a reused buffer copied out, an in-place output (`SubgraphIO.in_place`: a layer's
   `present_key` / `present_value`) being the very buffer fed as `past_key` / `past_value`, so the
   KV cache is written in place.

Output buffers come from the manifest's tensor specs in one place, `output_buffers`; a launch that
binds its outputs by address (onnxruntime's IOBinding, TensorRT) asks for them, while one that
brings its own (torch modules, CUDA graphs, onnxruntime's persistent CPU bindings) does not, so the
decode hot paths allocate nothing they do not use. What differs between backends is only how they
bind memory, never what they are asked.

Lifecycle: construction loads and checks everything (manifest, tensor names, files) and fails with a
clear error; then any number of lanes call `run` at once, each with its own `lane` name (a lane's
per-call state, such as bindings or CUDA graphs, is keyed by it, so it is bounded by the number of
lanes, not of calling threads); `close()` (or leaving a `with` block) frees what the backend created.

Threading model: the shared part of `run` reads only state set in `__init__` (`calls`, `device`);
each launch documents the per-lane state it keeps. `row_form` is worked out once, at its first ask (the first
`allocate_cache`, at load), under a lock of its own.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.graphs.manifest import Subgraph
from paradecode.graphs.ops import TORCH_DTYPES
from paradecode.graphs.tensors import SubgraphIO
from paradecode.runtime import row_exactness
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder
from paradecode.runtime.safetensors_bytes import tensor_from_safetensors

Launched = tuple[Mapping[str, torch.Tensor], bool]  # a launch's outputs, and whether it reuses their buffers


@dataclass(frozen=True)
class SubgraphCall:
    """What a call of one subgraph takes and gives, worked out once from its contract for the per-call steps."""

    io: SubgraphIO
    inputs: frozenset[str]  # every input, by name
    input_order: tuple[str, ...]  # every input, in the contract's order
    dtypes: dict[str, torch.dtype]  # input name -> its dtype
    outputs: tuple[str, ...]  # every output, in the contract's order
    output_set: frozenset[str]  # the same, for the filter
    in_place: dict[str, str]  # in-place output -> the input fed as its buffer
    produced: tuple[str, ...]  # the outputs a launch produces: every one not in place
    streamed: tuple[str, ...]  # the inputs that are not in-place buffers (the caches)

    @classmethod
    def of(cls, io: SubgraphIO) -> SubgraphCall:
        in_place = io.in_place
        return cls(
            io,
            frozenset(io.input_names),
            tuple(io.input_names),
            {t.name: TORCH_DTYPES[t.dtype] for t in io.inputs},
            tuple(io.output_names),
            frozenset(io.output_names),
            in_place,
            tuple(n for n in io.output_names if n not in in_place),
            tuple(n for n in io.input_names if n not in in_place.values()),
        )


class Backend(ABC):
    name = "base"

    def __init__(self, export: ExportFolder, device: str = "cpu"):
        self.export = export
        self.manifest = export.manifest
        self.spec = export.manifest.spec
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[self.manifest.dtype]
        self.subgraphs = {sub.io.name: sub for sub in self.manifest.subgraphs}
        self.calls = {name: SubgraphCall.of(sub.io) for name, sub in self.subgraphs.items()}
        self._moves_feeds = self.device.type != "cpu"  # CPU feeds are used where they are
        # Whether attention may read cache slots no position has written (masked). Off a CPU, as the torch modules on
        # CUDA do (a slice at the highest position would need a device-to-host copy); the exported graphs always.
        self.reads_whole_cache = self.device.type != "cpu"
        self._exit_vocab: torch.Tensor | None = None
        self._row_form: row_exactness.RowForm | None = None
        self._row_form_known = False
        self._row_form_lock = threading.Lock()  # the first ask probes; a second asker waits for its verdict

    def kernels_identity(self) -> str:
        """What this backend's calls' bits depend on besides the export and the CPU, in a row-form verdict's key
        (runtime/row_exactness.py): onnxruntime's version and build, unless a backend says otherwise."""
        return row_exactness.kernels_version()

    @property
    def probes_rows(self) -> bool:
        """Whether this backend's row form is probed on the machine (runtime/row_exactness.py) rather than taken to
        be `AS_IS`: where its kernels are known to give a lone row other bits (each backend says where)."""
        return False

    @property
    def row_form(self) -> row_exactness.RowForm | None:
        """How calls must be made for a position to get the same bits in a call of its own and among others on this
        machine (runtime/row_exactness.py), None where no form does: probed (or read from the cache of verdicts) at
        the first ask, which is the first `allocate_cache`, at load."""
        if not self._row_form_known:
            with self._row_form_lock:
                if not self._row_form_known:
                    self._row_form, self._row_form_known = row_exactness.row_form(self), True
        return self._row_form

    @property
    def subgraph_names(self) -> set[str]:
        return set(self.subgraphs)

    def exit_vocab(self) -> torch.Tensor | None:
        """The token ids of the exit heads' reduced vocabulary (int64 [N]), None when they use the whole
        vocabulary. Taken from the export's weights the first time it is asked for (sampling needs it to
        map an exit head's logits to tokens)."""
        if self.manifest.head_vocab is None:
            return None
        if self._exit_vocab is None:
            vocab = self.weights_tensor("exits.vocab")
            if tuple(vocab.shape) != (self.manifest.head_vocab,) or vocab.dtype != torch.int64:
                raise ManifestError(
                    f"exits.vocab in {self.manifest.weights} is {vocab.dtype} {list(vocab.shape)}; the manifest "
                    f"records {self.manifest.head_vocab} int64 token ids. Re-export the model."
                )
            self._exit_vocab = vocab
        return self._exit_vocab

    def weights_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` of the export's weights file as this model loaded it. Here, for a backend that keeps no
        copy of the file: read again, its sha256 checked against the manifest's (the one it was loaded with)."""
        return tensor_from_safetensors(self.export.read(self.manifest.weights), name, self.manifest.weights)

    # lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:  # noqa: B027 (a hook, not abstract: a backend that creates nothing frees nothing)
        """Free sessions, contexts and buffers this backend created."""

    def open_subgraphs(self) -> set[str]:
        """The subgraphs holding state of their own (sessions, compiled code) so far: where a backend opens them at
        their first call. None here: this backend holds nothing per subgraph that it opens late."""
        return set()

    def close_subgraphs(self, names: Collection[str]) -> None:  # noqa: B027 (a hook: nothing to close here)
        """Free what the subgraphs `names` hold; a later call opens them again."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # buffers -------------------------------------------------------------------------------
    def allocate_cache(self, batch: int = 1) -> KVCache:
        """A KV cache of `batch` rows (at most the export's max_batch) at the export's max length: a layer per decoder
        layer, and one more (L + 1) for the draft head's rows where the export has one; and where that head reads a
        low and a middle layer's outputs beside the last one's (the manifest's `draft.feature_layers`), those."""
        if batch > self.manifest.max_batch:
            raise UserInputError(
                f"a batch of {batch} rows needs an export with --max-batch {batch} or more; {self.export.path} was "
                f"exported with --max-batch {self.manifest.max_batch}. Re-export it, or batch fewer requests."
            )
        shape = (batch, self.spec.num_kv_heads, self.manifest.max_seq_len, self.spec.head_dim)
        layers = self.cache_layers
        features = (len(set(self.manifest.feature_layers)), self.spec.hidden_size)
        spare, grows = self.cache_spare, self.grows_cache
        return KVCache(layers, shape, self.dtype, self.device, spare, grows=grows, features=features)

    @property
    def cache_layers(self) -> int:
        """The layers a KV cache holds: the decoder's, and the draft head's (L + 1) where the export has one."""
        return self.spec.num_layers + (self.manifest.draft is not None)

    @property
    def grows_cache(self) -> bool:
        """Whether this backend's calls take a KV cache of any length up to max_seq_len, so that a cache may hold
        what its sequences need and grow (runtime/kvcache.py); not where fixed addresses are bound (CUDA graphs,
        TensorRT engines)."""
        return False

    @property
    def cache_spare(self) -> int:
        """A KV cache's slots after the last position, for copies of it: this machine's row form's
        (runtime/row_exactness.py)."""
        return (self.row_form or row_exactness.AS_IS).spare

    @property
    def cache_capacity(self) -> int:
        """The positions a sequence can take in a KV cache: its slots but the spare ones (`KVCache.capacity`)."""
        return self.manifest.max_seq_len - self.cache_spare

    def cache_bytes(self, batch: int = 1) -> int:
        """The bytes a KV cache of `batch` rows takes (keys and values of every layer)."""
        slots = batch * self.spec.num_kv_heads * self.manifest.max_seq_len * self.spec.head_dim
        return 2 * self.cache_layers * slots * self.dtype.itemsize

    def new_stream(self):
        """A stream for a new lane: a CUDA stream on a GPU, None on a CPU."""
        return torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def output_buffers(self, name: str, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output of subgraph `name` for this call, on the backend's device: the in-place ones are the fed
        buffers, the rest new, shaped by the manifest's specs at the call's batch and token count."""
        call = self.calls[name]
        batch, tokens = feeds[call.io.inputs[0].name].shape[:2]
        return {
            t.name: feeds[call.in_place[t.name]]
            if t.name in call.in_place
            else torch.empty(t.concrete(batch, tokens), dtype=TORCH_DTYPES[t.dtype], device=self.device)
            for t in call.io.outputs
        }

    # the one call ----------------------------------------------------------------------------
    def run(
        self,
        name: str,
        feeds: Mapping[str, torch.Tensor],
        lane: str = "main",
        outputs: Collection[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run subgraph `name` on `feeds` (every input by name) for `lane`; return its outputs by name: the
        ones named in `outputs`, or all of them (a backend need not copy out what is not asked for, such as
        a head's vocabulary-sized logits during greedy decoding).

        Raises UserInputError, before any launch, for a subgraph the export lacks or feeds that are not its
        inputs by name and dtype; a shape outside the contract is the launch's to refuse."""
        call = self.calls.get(name)
        if call is None or feeds.keys() != call.inputs:
            raise self._refusal(name, feeds)
        dtypes = call.dtypes
        for key, tensor in feeds.items():
            if tensor.dtype is not dtypes[key]:
                raise self._refusal(name, feeds)
        if self._moves_feeds:
            feeds = {k: v.to(self.device, non_blocking=True).contiguous() for k, v in feeds.items()}
        produced, reused = self._launch(name, feeds, lane)
        in_place = call.in_place
        return {
            n: feeds[in_place[n]] if n in in_place else produced[n].clone() if reused else produced[n]
            for n in (call.outputs if outputs is None else outputs)
            if n in call.output_set
        }

    @abstractmethod
    def _launch(self, name: str, feeds: Mapping[str, torch.Tensor], lane: str) -> Launched:
        """Run subgraph `name` on `feeds` (checked against its contract, on the device) for `lane`.

        Returns every output that is not in place (`SubgraphCall.produced`) by name, and whether those
        tensors are buffers the backend reuses on its next call (`run` copies out the ones asked for)."""

    def sharing(self, lanes: int):
        """A context manager: the calling thread's calls inside it run while `lanes` lanes in all compute at once
        (ParaDecode's side lanes), so a backend whose calls take several cores may give each call its share."""
        return contextlib.nullcontext()

    def _refusal(self, name: str, feeds: Mapping[str, torch.Tensor]) -> UserInputError:
        """Why `run` refuses this call: what arrived against what the subgraph's contract expects."""
        call = self.calls.get(name)
        if call is None:
            return UserInputError(f"the export has no subgraph {name!r}; it has {sorted(self.calls)}.")
        missing, unexpected = sorted(call.inputs - feeds.keys()), sorted(feeds.keys() - call.inputs)
        if missing or unexpected:
            return UserInputError(
                f"{name}: the feeds {sorted(feeds)} lack {missing} and have unexpected {unexpected}; "
                f"its inputs are {list(call.io.input_names)}."
            )
        for spec in call.io.inputs:
            tensor = feeds[spec.name]
            if tensor.dtype is not call.dtypes[spec.name]:
                return UserInputError(
                    f"{name}: input {spec.name} arrived as {tensor.dtype} {list(tensor.shape)}; the contract "
                    f"expects {spec.dtype} {list(spec.shape)}."
                )
        raise AssertionError(f"{name}: refused a call whose feeds match the contract")  # a bug in `run`'s check

    # checks --------------------------------------------------------------------------------
    def check_names(self, sub: Subgraph, inputs, outputs, what: str) -> None:
        """Compare a loaded graph's tensor names with the manifest's; report both differences as sets."""
        problems = []
        for kind, actual, expected in (
            ("inputs", set(inputs), set(sub.io.input_names)),
            ("outputs", set(outputs), set(sub.io.output_names)),
        ):
            missing, unexpected = expected - actual, actual - expected
            if missing or unexpected:
                problems.append(f"{kind}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        if problems:
            raise ManifestError(
                f"{what} for {sub.io.name} does not match the manifest ({'; '.join(problems)}). "
                "The export is inconsistent: re-export the model."
            )
