"""Exit heads: the data they learn from, their distillation, and the choice of where and when they fire.

- `data`: the model's own greedy continuations, generated in batches, recorded by hooks as they go;
- `vocab`: the reduced vocabulary (the final layer's most frequent predictions) and its size budget;
- `training`: one d x d transform per exit layer over that vocabulary, distilled from the final layer;
- `calibration`: the exit layers and thresholds with the best expected speed, by the cost model
  (`paradecode.tools.cost_model`) of the calls a decode step makes, measured on this machine
  (`paradecode.tools.call_costs`);
- `pipeline`: all of it in order, for `paradecode-train-heads`.

The heads file itself (save, load, check against a model) is `paradecode.export.heads`, since the
exporter reads it.
"""
