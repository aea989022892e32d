"""The KV cache: one fixed-size key and value buffer per layer, written in place by the layer graphs.

Buffers are allocated once at the export's max length. Each layer has its own length, the number of
positions computed at that layer: while tokens are pending, shallow layers hold more positions than
deep ones. Rolling back only shortens lengths: the graphs mask every slot at or after a query's
position, so stale values past a length never matter and are overwritten when reached again.
"""

from __future__ import annotations

import torch

from paradecode.graphs.errors import UserInputError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: str | torch.device,
        spare: int = 0,
        zeroed: bool = False,
    ):
        self.shape = tuple(shape)
        # Slots at the end that no position takes, kept for copies written after a call's last position: the graphs'
        # (padded attention, export/exact_rows.py: one slot) and the runtime's (a row form's padding,
        # runtime/row_exactness.py: up to `RowForm.spare`). Every position gets a slot of its own before them.
        self.spare = spare
        # `zeroed`: the buffers start at 0, for a backend whose attention reads every slot, masked (the torch modules
        # on CUDA and under torch.compile): masked garbage could be NaN, and 0 x NaN would leak through the masked
        # softmax. Where only written slots are read (the ONNX graphs and the eager modules on a CPU slice the cache
        # at the call's highest position), they need not be: untouched pages cost no memory until the sequence
        # reaches them.
        new = torch.zeros if zeroed else torch.empty
        self.keys = [new(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [new(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows start..stop-1 of this one's buffers (views, no copy), with lengths of its own: a
        batch's requests each decode in their rows of one cache [max_batch, H_kv, S, D_h]."""
        view = KVCache.__new__(KVCache)
        view.shape = (stop - start, *self.shape[1:])
        view.spare = self.spare
        view.keys = [k[start:stop] for k in self.keys]
        view.values = [v[start:stop] for v in self.values]
        view.lengths = list(self.lengths)
        return view

    def zero(self, row: int, start: int, stop: int) -> None:
        """Zero slots start..stop-1 of `row` in every layer (slots a batched call may read, masked, before the row
        reaches them: see runtime/engine.py)."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[row, :, start:stop] = 0

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy row `source`'s first `length` positions of every layer into row `target` (a batch closing a gap)."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[target, :, :length] = buffer[source, :, :length]

    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def capacity(self) -> int:
        """The positions a sequence can take: the buffers' slots but the spare ones."""
        return self.shape[2] - self.spare

    @property
    def num_layers(self) -> int:
        return len(self.lengths)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers of `layer` (1-based)."""
        return self.keys[layer - 1], self.values[layer - 1]

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
