"""The KV cache: per layer, a key and a value buffer [rows, H_kv, slots, D_h], written in place by the layer graphs.

Each layer has its own length, the number of positions computed at that layer: while tokens are pending, shallow
layers hold more positions than deep ones. Rolling back only shortens lengths: the graphs mask every slot after a
query's position, so stale values past a length never matter and are overwritten when reached again.

How many slots the buffers hold: an exported layer attends over every slot of the cache it is given, masked
(export/attention.py), so a call costs what its cache holds, not what the sequence needs. Where the backend's graphs
take a cache of any length (`grows`: onnxruntime's), the buffers start at GRANULE slots and grow in steps of GRANULE
to what the next call needs (`reserve`), up to the export's max_seq_len: growing copies every row's slots into new
buffers, a few times over a sequence. An engine drops its cache back to GRANULE slots (`shrink`) as soon as
it has no sequence left, and its views follow. Elsewhere (CUDA graphs and TensorRT engines bind fixed addresses)
they hold max_seq_len slots from the start. Every slot is a finite number from the start (zeros): a masked slot
adds an exact zero only if it holds no NaN.

A cache of several rows (a batch's requests, runtime/engine.py) hands out views of some of its rows (`rows`), each
with lengths of its own; a view sees the buffers its cache has now, grown or not.

Where the export's draft head reads the outputs of a low and a middle layer beside the last one's (the manifest's
`draft.feature_layers`), the cache also holds those outputs at every position ([rows, slots, D] each, `features`),
written by the calls that compute those layers (runtime/decoding.py) and grown, viewed and forgotten as the keys
and values are: a position's entry is that of its newest computation, which for a verified position is the one
verified.

Threading model: a cache grows only from the thread that decodes in it; the `streams` and `both` overlaps, whose
side lanes write into it from other threads, reserve every slot before their lanes start (runtime/overlaps.py).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from paradecode.graphs.errors import UserInputError

GRANULE = 64  # slots a growing cache adds at a time
NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


class KVCache:
    def __init__(
        self,
        num_layers: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: str | torch.device,
        spare: int = 0,
        *,
        grows: bool = False,
        features: tuple[int, int] = (0, 0),
    ):
        """A cache of `num_layers` layers, `shape` = (rows, H_kv, most slots, D_h). `spare`: slots at the end that no
        position takes, kept for copies written after a call's last position (a row form's padding,
        runtime/row_exactness.py: up to `RowForm.spare`). `features`: (how many layers' outputs, their width) it
        holds at every position besides (a draft head's feature layers), (0, 0) for none."""
        self.shape = tuple(shape)  # the most it holds: max_seq_len slots
        self.spare = spare
        self.lengths = [0] * num_layers
        self.dtype, self.device = dtype, torch.device(device)
        self.grows = grows
        self.generation = 0  # counts the buffers' reallocations (views refresh theirs after one)
        self._root, self._offset = self, 0
        # the views of its rows, refreshed when the buffers are reallocated: a view kept with the old buffers held
        # them alive (a server's engine kept a batch size's view, and every cache generation it had seen: issue 52)
        self._views: weakref.WeakSet[KVCache] = weakref.WeakSet()
        self.feature_width = features[1]
        slots = min(GRANULE, self.shape[2]) if grows else self.shape[2]
        self.keys = [self._new(slots) for _ in range(num_layers)]
        self.values = [self._new(slots) for _ in range(num_layers)]
        self.features = [self._new(slots, features=True) for _ in range(features[0])]
        self._seen = self.generation

    def _new(self, slots: int, *, features: bool = False) -> torch.Tensor:
        """A zeroed key or value buffer [rows, H_kv, slots, D_h], or with `features` a features one [rows, slots, D]."""
        root = self._root
        rows, heads, _, dim = root.shape
        shape = (rows, slots, root.feature_width) if features else (rows, heads, slots, dim)
        if root.device.type == "cpu" and root.dtype in NUMPY_DTYPES:
            # numpy's zeros: pages the kernel zeroes as they are first touched, and no thread pool (torch's parallel
            # fill woke its threads beside onnxruntime's spinning ones: ms per buffer)
            return torch.from_numpy(np.zeros(shape, dtype=NUMPY_DTYPES[root.dtype]))
        return torch.zeros(shape, dtype=root.dtype, device=root.device)

    # --- rows ---------------------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows start..stop-1 of this one's buffers (views, no copy), with lengths of its own: a
        batch's requests each decode in their rows of one cache [max_batch, H_kv, S, D_h]."""
        view = KVCache.__new__(KVCache)
        view.shape = (stop - start, *self.shape[1:])
        view.spare = self.spare
        view.lengths = list(self.lengths)
        view.dtype, view.device, view.grows = self.dtype, self.device, self.grows
        view.feature_width = self.feature_width
        view._root, view._offset = self._root, self._offset + start
        view._refresh()
        self._root._views.add(view)
        return view

    def _refresh(self) -> None:
        """A view's buffers: its rows of its cache's current ones."""
        root = self._root
        first, last = self._offset, self._offset + self.shape[0]
        whole = first == 0 and last == root.shape[0]
        self.keys = [k if whole else k[first:last] for k in root.keys]
        self.values = [v if whole else v[first:last] for v in root.values]
        self.features = [f if whole else f[first:last] for f in root.features]
        self._seen = root.generation

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy row `source`'s first `length` positions of every layer into row `target` (a batch closing a gap)."""
        for buffers in (self._root.keys, self._root.values):
            for buffer in buffers:
                buffer[target, :, :length] = buffer[source, :, :length]
        for buffer in self._root.features:
            buffer[target, :length] = buffer[source, :length]

    # --- slots --------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """The slots the buffers hold now (at most `shape[2]`)."""
        return self._root.keys[0].shape[2]

    def reserve(self, end: int) -> None:
        """Make the buffers hold slots 0..end-1 (a call writing or reading up to position end - 1): a growing cache
        grows to the next multiple of GRANULE (at most its most slots), copying what it holds; a call past the most
        slots is the graphs' to refuse."""
        root = self._root
        if end <= root.keys[0].shape[2] or not root.grows:
            return
        slots = min(root.shape[2], -(-end // GRANULE) * GRANULE)
        held = root.keys[0].shape[2]
        for buffers in (root.keys, root.values, root.features):
            features = buffers is root.features
            for i, old in enumerate(buffers):
                new = root._new(slots, features=features)
                kept = (slice(None), slice(0, held)) if features else (slice(None), slice(None), slice(0, held))
                if new.device.type == "cpu" and old.dtype in NUMPY_DTYPES:
                    new.numpy()[kept] = old.numpy()  # one thread's copy, as `_new` says why
                else:
                    new[kept] = old
                buffers[i] = new
        root._reallocated()

    def shrink(self) -> None:
        """Drop a growing cache back to its first GRANULE slots, nothing kept: for an engine none of whose rows
        holds a sequence. Every call attends over every slot the buffers hold, so the slots a long sequence left
        behind would slow every later one."""
        root = self._root
        if not root.grows or root.keys[0].shape[2] <= GRANULE:
            return
        slots = min(GRANULE, root.shape[2])
        root.keys = [root._new(slots) for _ in root.keys]
        root.values = [root._new(slots) for _ in root.values]
        root.features = [root._new(slots, features=True) for _ in root.features]
        root.lengths = [0] * len(root.lengths)
        root._reallocated()

    def _reallocated(self) -> None:
        self.generation += 1
        for view in list(self._views):
            view._refresh()

    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def capacity(self) -> int:
        """The positions a sequence can take: the most slots but the spare ones."""
        return self.shape[2] - self.spare

    @property
    def num_layers(self) -> int:
        return len(self.lengths)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers of `layer` (1-based), as they are now."""
        if self._seen != self._root.generation:
            self._refresh()
        return self.keys[layer - 1], self.values[layer - 1]

    def feature(self, index: int) -> torch.Tensor:
        """The `index`-th feature layer's outputs [rows, slots, D], as they are now."""
        if self._seen != self._root.generation:
            self._refresh()
        return self.features[index]

    def zero(self, layer: int, start: int, end: int) -> None:
        """Zero `layer`'s (1-based) keys and values at slots start..end-1 in this view's rows: slots a call leaves
        unwritten that later queries read, made to hold what a fresh cache holds (nothing of an earlier sequence)."""
        self.reserve(end)
        key, value = self.layer(layer)
        key[:, :, start:end] = 0
        value[:, :, start:end] = 0

    # --- lengths ------------------------------------------------------------------------------
    def written(self, layer: int, end: int) -> None:
        """Record that `layer` now holds positions 0 .. end-1."""
        if end > self.capacity:
            raise UserInputError(f"position {end - 1} is past the cache's {self.capacity} slots.")
        self.lengths[layer - 1] = max(self.lengths[layer - 1], end)

    def rollback(self, length: int) -> None:
        """Keep positions 0 .. length-1 at every layer; everything later is discarded."""
        if length < 0:
            raise ValueError(f"cannot roll back to a negative length ({length})")
        self.lengths = [min(n, length) for n in self.lengths]

    def reset(self) -> None:
        self.rollback(0)
