"""Exit heads: the data they learn from, their distillation, and the choice of where and when they fire.

- `data`: the model's own greedy text, hidden states after each exit layer, the held-out split;
- `training`: one d x d transform per exit layer, distilled from the final layer (DESIGN.md §2);
- `cost`: the decode cost model that says whether an exit layer pays for its head;
- `calibration`: per exit layer the lowest threshold meeting a target agreement, and the set of
  exit layers to use.

The heads file itself (save, load, check against a model) is `paradecode.export.heads`, since the
exporter reads it.
"""
