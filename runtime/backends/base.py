"""The interface every backend implements: one generic subgraph call driven by the contract.

A backend runs the export's subgraphs by name: `run(name, feeds, lane) -> outputs`, where `feeds`
holds every input of the subgraph's contract (`graphs.tensors`) by name and the result every output
by name (Polygraphy's `infer(feed_dict)`, TensorRT-LLM's `Session.run(inputs, outputs, stream)`).
Outputs are allocated from the manifest's tensor specs, except the in-place ones
(`graphs.tensors.IN_PLACE`): a layer's `present_key` / `present_value` are the very buffers fed as
`past_key` / `past_value`, so the KV cache is written in place. What differs between backends is
only how they bind memory, never what they are asked.

Lifecycle: construction loads and checks everything (manifest, tensor names, files) and fails with a
clear error; then any number of lanes call `run` at once, each with its own `lane` name (a lane's
per-call state, such as bindings or CUDA graphs, is keyed by it, so it is bounded by the number of
lanes, not of calling threads); `close()` (or leaving a `with` block) frees what the backend created.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from paradecode.graphs.errors import ManifestError
from paradecode.graphs.manifest import Subgraph
from paradecode.graphs.ops import TORCH_DTYPES
from paradecode.graphs.tensors import IN_PLACE, TensorSpec
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder


class Backend:
    name = "base"

    def __init__(self, export: ExportFolder, device: str = "cpu"):
        self.export = export
        self.manifest = export.manifest
        self.spec = export.manifest.spec
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[self.manifest.dtype]
        self.subgraphs = {sub.io.name: sub for sub in self.manifest.subgraphs}
        self._exit_vocab: torch.Tensor | None = None

    @property
    def subgraph_names(self) -> set[str]:
        return set(self.subgraphs)

    def exit_vocab(self) -> torch.Tensor | None:
        """The token ids of the exit heads' reduced vocabulary (int64 [N]), None when they use the whole
        vocabulary. Read from the export's weights file the first time it is asked for (sampling needs it to
        map an exit head's logits to tokens)."""
        if self.manifest.head_vocab is None:
            return None
        if self._exit_vocab is None:
            from safetensors import safe_open

            with safe_open(str(self.export.file(self.manifest.weights)), framework="pt") as f:
                vocab = f.get_tensor("exits.vocab")
            if tuple(vocab.shape) != (self.manifest.head_vocab,) or vocab.dtype != torch.int64:
                raise ManifestError(
                    f"exits.vocab in {self.manifest.weights} is {vocab.dtype} {list(vocab.shape)}; the manifest "
                    f"records {self.manifest.head_vocab} int64 token ids. Re-export the model."
                )
            self._exit_vocab = vocab
        return self._exit_vocab

    # lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free sessions, contexts and buffers this backend created."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # buffers -------------------------------------------------------------------------------
    def allocate_cache(self) -> KVCache:
        shape = (1, self.spec.num_kv_heads, self.manifest.max_seq_len, self.spec.head_dim)
        return KVCache(self.spec.num_layers, shape, self.dtype, self.device)

    def new_stream(self):
        """A stream for a new lane: a CUDA stream on a GPU, None on a CPU."""
        return torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def allocate(self, spec: TensorSpec, batch: int, tokens: int) -> torch.Tensor:
        """An output buffer for `spec` at this call's batch and token count, on the backend's device."""
        return torch.empty(spec.concrete(batch, tokens), dtype=TORCH_DTYPES[spec.dtype], device=self.device)

    def allocate_outputs(self, name: str, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output of subgraph `name`: the in-place ones are the fed buffers, the rest are new."""
        io = self.subgraphs[name].io
        batch, tokens = feeds[io.inputs[0].name].shape[:2]
        return {
            t.name: feeds[IN_PLACE[t.name]] if t.name in IN_PLACE else self.allocate(t, batch, tokens)
            for t in io.outputs
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
        a head's vocabulary-sized logits during greedy decoding)."""
        raise NotImplementedError

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
