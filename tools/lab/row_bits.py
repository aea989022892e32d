"""Which of the torch backend's calls give a position other bits in a call of several positions than alone.

    python tools/lab/row_bits.py EXPORT OUT.json [--device cuda]

For the export on the torch backend, eager and compiled, with its 4-bit weights dequantized and (where it has
some) read by torch's int4 kernels: the same positions of a fixed prompt computed in calls of every size the row
probe compares (runtime/row_exactness.py), through each path decoding uses, each against the calls of one
position: whether the bits agree and the largest difference of the last hidden state; then what the probe itself
finds. Written for the question the H100 run of 2026-11-28 left open (ParaDecode on int4 kernels, compiled, gave
another output than plain decoding in 1 of 12 SmolLM2 prompts, 2 with the exit heads always on): which call, which
size, eager or compiled.
"""

import argparse
import json
import time
from pathlib import Path

from paradecode.runtime import row_exactness
from paradecode.runtime.backends.torch_backend import TorchBackend
from paradecode.runtime.loader import open_export


def sizes_compared(backend) -> dict:
    """{"path size": {"same", "max_abs_diff"}} for every path and size the probe compares, under `AS_IS`."""
    positions = row_exactness._Positions.of(backend)
    if positions is None:
        raise SystemExit(f"{backend.export.path}: its KV cache is too small to compare positions (see the warning).")
    reference = positions.results(row_exactness.AS_IS, 1, "segments")
    report = {}
    for path, size in positions.compared():
        got = positions.results(row_exactness.AS_IS, size, path)
        report[f"{path} {size}"] = {
            "same": row_exactness._same(reference, got),
            "max_abs_diff": (got[0].float() - reference[0].float()).abs().max().item(),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export")
    parser.add_argument("out", type=Path, help="the JSON report")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    device, export = args.device, open_export(args.export)
    quantized = export.manifest.quantization is not None
    report = {}
    for int4 in (True, False) if quantized else (False,):
        for compiled in (False, True):
            name = f"int4 kernels {'on' if int4 else 'off'}, {'compiled' if compiled else 'eager'}"
            began = time.perf_counter()
            backend = TorchBackend(export, device=device, int4_kernels=int4, torch_compile=compiled)
            try:
                sizes = sizes_compared(backend)
                form = row_exactness.probe(backend)
            finally:
                backend.close()
            report[name] = {
                "sizes": sizes,
                "differing": [key for key, value in sizes.items() if not value["same"]],
                "probe": None if form is None else form.name,
                "seconds": round(time.perf_counter() - began, 1),
            }
            print(name, json.dumps({k: v for k, v in report[name].items() if k != "sizes"}), flush=True)
    args.out.write_text(json.dumps({"export": args.export, "device": device, "cases": report}, indent=1))


if __name__ == "__main__":
    main()
