"""`paradecode-footprint DIR`: what an export costs on disk and in memory, against its weights.

It reports the export's size on disk, the bytes of its weights (each stored once, in the export dtype),
and the growth of this process's resident memory (RSS, Linux) when the export is loaded and after one
generation, each also as a multiple of the weights. The growth is measured from after the libraries are
imported, so it is what the model itself costs: its sessions' weights, its KV cache as far as it is
touched, its tokenizer and the runtime's own state.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path

from paradecode.graphs.errors import UserInputError, run_command
from paradecode.runtime.backends import BACKENDS


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise UserInputError("paradecode-footprint reads /proc/self/status: it runs on Linux only.")


def measure(export: Path, backend: str, prompt: str, max_new_tokens: int) -> dict:
    import onnxruntime  # noqa: F401  (imported before the first reading: libraries are not the model)
    import torch  # noqa: F401

    from paradecode.runtime import load
    from paradecode.runtime.loader import open_export

    folder = open_export(export, verify=False)
    disk = sum(p.stat().st_size for p in Path(export).rglob("*") if p.is_file())
    weights = folder.file(folder.manifest.weights).stat().st_size
    gc.collect()  # earlier work's garbage, freed during the load, would count against the model
    before = rss_mb()
    model = load(export, backend=backend)
    loaded = rss_mb()
    try:
        if model.chat_template is not None:
            result = model.generate(messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens)
        else:
            result = model.generate(prompt, max_new_tokens=max_new_tokens)
        generated = rss_mb()
    finally:
        model.close()
    mb = 1024 * 1024
    return {
        "export": str(Path(export).resolve()),
        "backend": backend,
        "dtype": folder.manifest.dtype,
        "max_seq_len": folder.manifest.max_seq_len,
        "weights_mb": weights / mb,
        "disk_mb": disk / mb,
        "disk_vs_weights": disk / weights,
        "rss_growth_loaded_mb": loaded - before,
        "rss_growth_after_generation_mb": generated - before,
        "rss_vs_weights_loaded": (loaded - before) * mb / weights,
        "rss_vs_weights_after_generation": (generated - before) * mb / weights,
        "new_tokens": len(result.token_ids),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paradecode-footprint", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, metavar="DIR", help="a folder written by paradecode-export")
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="onnxruntime")
    parser.add_argument("--prompt", default="Write a Python function that reverses a list.", help="the generation")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    code, figures = run_command(
        "paradecode-footprint", lambda: measure(args.export, args.backend, args.prompt, args.max_new_tokens)
    )
    if code:
        return code
    if args.json:
        from paradecode.tools.reporting import save_json

        save_json(args.json, figures)
    print(
        f"weights {figures['weights_mb']:.0f} MiB ({figures['dtype']}); on disk {figures['disk_mb']:.0f} MiB "
        f"({figures['disk_vs_weights']:.2f}x); RSS growth {figures['rss_growth_loaded_mb']:.0f} MiB loaded "
        f"({figures['rss_vs_weights_loaded']:.2f}x), {figures['rss_growth_after_generation_mb']:.0f} MiB after "
        f"{figures['new_tokens']} tokens ({figures['rss_vs_weights_after_generation']:.2f}x)"
    )
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
