"""`paradecode-characterise`: ParaDecode's speedup against acceptance rate and exit depth, next to its bound.

A random-weight Llama of realistic layer widths is exported with one exit layer at each requested
depth. Acceptance is controlled: at the exit layer the head runs as usual (its cost is real), and
the token exits, with the reference (ar) token, for a fixed pseudo-random share `a` of positions,
the same positions in every mode; other tokens go on. Every exit is correct, so this measures the
scheduler, not the heads. ar and each ParaDecode overlap run interleaved, R times.

The bound (docs/design.md §6), in layer-times per token, with a the share of tokens that exit at depth e
of L layers and k = K + 1 positions sharing a batched call:
    streams (two lanes, perfect overlap):  a * max(e, L - e)        + (1 - a) * L
    batched (one lane):                    a * (e + (L - e) / k)    + (1 - a) * L
    both:                                  a * max(e, (L - e) / k)  + (1 - a) * L
Speedup bound = L / that. It leaves out the exit head's own cost, the embedding and the final head,
per-call overhead and lane contention: the gap to it is what the scheduler loses to those.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from paradecode.export.heads.cost_model import OVERLAPS as BOUNDED_OVERLAPS
from paradecode.export.heads.cost_model import CostModel
from paradecode.graphs.errors import ParadecodeError, UserInputError, run_command
from paradecode.graphs.tensors import DTYPES
from paradecode.runtime.backends import BACKENDS
from paradecode.tools.harness import Mode, Sample
from paradecode.tools.options import choice_list

# BOUNDED_OVERLAPS: the overlaps with a bound (the cost model's; `auto` picks one of them per device). The
# export is ONNX only, so every backend but TensorRT (which needs engines) can run it.
ONNX_BACKENDS = tuple(b for b in BACKENDS if b != "tensorrt")

logger = logging.getLogger("paradecode.characterise")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradecode-characterise", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--acceptance", type=floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--depths", type=floats, default=[0.25, 0.5], help="exit depths as shares of the layers")
    parser.add_argument(
        "--overlaps",
        type=choice_list(BOUNDED_OVERLAPS, "--overlaps"),
        default="batched,streams,both",
        help=f"comma-separated, from {', '.join(BOUNDED_OVERLAPS)} (default batched,streams,both)",
    )
    parser.add_argument("--max-unverified", type=int, default=5, metavar="K")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument(
        "--no-segments",
        dest="segments",
        action="store_false",
        help="export one graph per layer only (no segment graphs): every token then takes one call per layer",
    )
    parser.add_argument("--backend", choices=ONNX_BACKENDS, default="onnxruntime")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch backend: compile every subgraph module with torch.compile; ar also runs uncompiled ('ar (eager)')",
    )
    parser.add_argument("--json", type=Path, metavar="OUT")
    parser.add_argument("--plot", type=Path, metavar="OUT.png")
    parser.add_argument("--work-dir", type=Path, help="keep the model and export here (default: a temporary folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, table = run_command("paradecode-characterise", lambda: run(args))
    if code == 0:
        print(table)
    return code


def bounds(a: float, e: int, layers: int, k: int) -> dict[str, float]:
    """The speedup bound per overlap: the cost model of docs/design.md §6's idealised costs (`CostModel.bound`)."""
    return {overlap: CostModel.bound(layers, k, overlap).speedup({e: a}, [e]) for overlap in BOUNDED_OVERLAPS}


def oracle(reference: list[int], layer: int, share: float, seed: int = 0):
    """Exit at `layer` with the reference token for a fixed pseudo-random share of positions."""

    def policy(position: int, exit_layer: int, out) -> int | None:
        if exit_layer != layer or position + 1 >= len(reference):
            return None
        if random.Random(position * 7919 + seed).random() < share:
            return reference[position + 1]
        return None

    return policy


@dataclass(frozen=True)
class LlamaShape:
    """A Llama's layer widths and counts (head_dim = hidden / heads)."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )


def random_llama(shape: LlamaShape, dtype: str = "float32"):
    """A Llama of `shape` with transformers' random initialisation (seed 0), in `dtype`, in eval mode, on the CPU."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(shape.config()).to(getattr(torch, dtype)).eval()


def build_model(args, folder: Path) -> Path:
    shape = LlamaShape(args.hidden, args.ffn, args.layers, args.heads, args.kv_heads, args.vocab)
    random_llama(shape).save_pretrained(folder)
    return folder


def run(args) -> str:
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.tools.bench_modes import copy_bandwidth, opened_with_ar_baselines, weight_bytes_per_token
    from paradecode.tools.reporting import save_figure, save_json

    depths = sorted({max(1, min(args.layers - 1, round(d * args.layers))) for d in args.depths})
    if any(not 0 <= a <= 1 for a in args.acceptance):
        raise UserInputError(f"acceptance rates must be in [0, 1], got {args.acceptance}.")
    with tempfile.TemporaryDirectory(prefix="paradecode-char-") as tmp:
        work = args.work_dir or Path(tmp)
        model_dir, export_dir = work / "model", work / "export"
        if not (export_dir / "manifest.json").is_file():
            logger.info(
                "building a random Llama (hidden %d, ffn %d, %d layers) and exporting it",
                args.hidden,
                args.ffn,
                args.layers,
            )
            build_model(args, model_dir)
            export_model(
                ExportConfig(
                    model=str(model_dir),
                    output=export_dir,
                    exit_layers=tuple(depths),
                    max_seq_len=128,
                    max_unverified=args.max_unverified,
                    dtype=args.dtype,
                    segments=args.segments,
                    force=True,
                )
            )
        opened = opened_with_ar_baselines(
            export_dir, backend=args.backend, device=args.device, torch_compile=args.compile
        )
        with opened as (pd_model, ar_models):
            measured = measure(args, depths, pd_model, ar_models)
        bandwidth = copy_bandwidth(args.device)
        weight_bytes = weight_bytes_per_token(export_dir)
    payload = {
        "shape": {k: getattr(args, k) for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab")},
        "dtype": args.dtype,
        "segments": args.segments,
        "torch_compile": args.compile,
        "baseline": measured["baseline"],
        "ar_tokens_per_second": measured["ar_tokens_per_second"],
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_token": weight_bytes,
        "ar_bandwidth_bound_tokens_per_second": bandwidth / weight_bytes,
        "ar_variants": measured["ar_variants"],
        "max_unverified": args.max_unverified,
        "max_new_tokens": args.max_new_tokens,
        "repeat": args.repeat,
        "results": measured["results"],
    }
    if args.json:
        from paradecode.tools.bench_modes import machine

        save_json(args.json, {**payload, "machine": machine()})
    if args.plot:
        save_figure(args.plot, figure(payload))
    return table(payload)


def measure(args, depths: list[int], pd_model, ar_models: dict) -> dict:
    """ar (each baseline) and every (exit layer, acceptance, overlap) case, interleaved, after a warm-up
    pass at full length; every case must reproduce ar's tokens. Returns the baseline and the rows."""
    from paradecode.runtime import Tracing
    from paradecode.tools import harness
    from paradecode.tools.bench_modes import generate_mode

    prompt = [(17 * i + 5) % args.vocab for i in range(16)]
    reference = (
        prompt
        + pd_model.generate(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True, mode="ar").token_ids
    )
    modes = [generate_mode(name, m, {"mode": "ar", "ignore_eos": True}) for name, m in ar_models.items()]
    cases = {}
    for e in depths:
        for a in args.acceptance:
            for o in args.overlaps:
                settings = {
                    "overlap": o,
                    "thresholds": {d: (0.0 if d == e else float("inf")) for d in depths},
                    "max_unverified": args.max_unverified,
                    "tracing": Tracing(exit_policy=oracle(reference, e, a)),
                    "lookup_tokens": 0,  # controlled exits alone: lookup proposals would add tokens of their own
                    "ignore_eos": True,
                }
                mode = checked(
                    generate_mode(f"exit {e} acceptance {a:g} {o}", pd_model, settings), reference[len(prompt) :]
                )
                cases[mode.name] = (e, a, o)
                modes.append(mode)
    results = harness.measure(
        modes, [prompt], max_new_tokens=args.max_new_tokens, repeat=args.repeat, warmup_tokens=args.max_new_tokens
    )
    ar_name = results.baseline
    rows = []
    for name, (e, a, o) in cases.items():
        share = statistics.median(sum(s.accepted.values()) / len(s.token_ids) for s in results.runs(name))
        rows.append(
            {
                "exit_layer": e,
                "acceptance": a,
                "exit_share": share,
                "overlap": o,
                "tokens_per_second": results.tokens_per_second(name).median,
                "speedup": results.speedup(name, ar_name).as_dict(),
                "bound": bounds(share, e, args.layers, args.max_unverified + 1)[o],
            }
        )
    return {
        "baseline": ar_name,
        "ar_tokens_per_second": results.tokens_per_second(ar_name).median,
        "ar_variants": {n: results.tokens_per_second(n).median for n in ar_models},
        "results": rows,
    }


def checked(mode: Mode, expected: list[int]) -> Mode:
    """`mode`, raising when its tokens differ from `expected` (ar's): every exit the oracle makes is correct."""

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        sample = mode.run(prompt_ids, max_new_tokens)
        if sample.token_ids != expected:
            raise ParadecodeError(f"parity lost at {mode.name}: the scheduler changed the output")
        return sample

    return replace(mode, run=run)


def table(payload: dict) -> str:
    lines = [
        f"baseline {payload['baseline']}: {payload['ar_tokens_per_second']:.1f} tokens/s; shape {payload['shape']}, "
        f"{payload['dtype']}, {'segments' if payload['segments'] else 'one graph per layer'}"
        f"{', torch.compile' if payload.get('torch_compile') else ''}",
        f"memory-bandwidth bound of ar: {payload['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token at "
        f"{payload['copy_bandwidth_gb_s']:.1f} GB/s measured copy bandwidth = "
        f"{payload['ar_bandwidth_bound_tokens_per_second']:.1f} tokens/s",
        "ar variants (median tokens/s): "
        + ", ".join(f"{name} {rate:.1f}" for name, rate in payload["ar_variants"].items() if rate is not None),
        "",
        "| exit layer | acceptance | exits done | overlap | tok/s | speedup (min-max) | bound |",
        "| ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for r in payload["results"]:
        s = r["speedup"]
        lines.append(
            f"| {r['exit_layer']} | {r['acceptance']:.2f} | {r['exit_share']:.2f} | {r['overlap']} | "
            f"{r['tokens_per_second']:.1f} | {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}) | "
            f"{r['bound']:.2f}x |"
        )
    return "\n".join(lines)


def figure(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({r["exit_layer"] for r in payload["results"]})
    fig, axes = plt.subplots(1, len(layers), figsize=(6 * len(layers), 4.5), squeeze=False)
    for axis, e in zip(axes[0], layers):
        for i, overlap in enumerate(sorted({r["overlap"] for r in payload["results"]})):
            rows = sorted(
                (r for r in payload["results"] if r["exit_layer"] == e and r["overlap"] == overlap),
                key=lambda r: r["acceptance"],
            )
            color = f"C{i}"
            med = [r["speedup"]["median"] for r in rows]
            err = [
                [m - r["speedup"]["min"] for m, r in zip(med, rows)],
                [r["speedup"]["max"] - m for m, r in zip(med, rows)],
            ]
            axis.errorbar(
                [r["exit_share"] for r in rows],
                med,
                yerr=err,
                marker="o",
                color=color,
                capsize=3,
                label=f"{overlap} measured",
            )
            axis.plot(
                [r["exit_share"] for r in rows],
                [r["bound"] for r in rows],
                ls="--",
                color=color,
                label=f"{overlap} bound",
            )
        axis.axhline(1.0, color="grey", lw=0.8)
        axis.set_title(f"exit after layer {e} of {payload['shape']['layers']}")
        axis.set_xlabel("share of tokens exiting early (all correct)")
        axis.set_ylabel("speedup over ar")
        axis.legend(fontsize=8)
    fig.suptitle(f"ParaDecode vs the bound of docs/design.md §6; random Llama {payload['shape']}")
    return fig


if __name__ == "__main__":
    sys.exit(main())
