"""Exit heads, from training to the file the exporter reads: product code, since their output ships
in the wheel (tools/models/) and the runtime tells users to train them.

- `file`: the heads file (save, load, check against a model), which `paradecode-export --heads` reads;
- `data`: the model's own greedy continuations, generated in batches, recorded by hooks as they go;
- `vocab`: the reduced vocabulary (the final layer's most frequent predictions) and its size budget;
- `training`: one d x d transform per exit layer over that vocabulary, distilled from the final layer;
- `call_costs`: what the calls of a decode step cost on this machine, timed through the runtime's own
  backends, over an export's graphs or over graphs traced from a model's spec;
- `cost_model`: what a token costs under ParaDecode and under plain decoding, from those costs;
- `calibration`: the exit layers and thresholds with the best expected speed by that cost model;
- `pipeline`: all of it in order; `cli`: `paradecode-train-heads`.

The one dependency of `export` on `runtime` is here: `call_costs` measures by running graphs the way the
runtime runs them (its loader and backends, or a loaded export; imported where used), and `cost_model`
models the runtime's overlaps (their names). The runtime never imports `export`.
"""

from paradecode.export.heads.file import check_heads, load_heads, save_heads

__all__ = ["check_heads", "load_heads", "save_heads"]
