"""`python tools/lab/peer_shapes.py CASE`: Hugging Face's static-cache `generate` beside paradecode's plain
decoding and ParaDecode's defaults, on a random-weight Llama of a real model's shape, against two bounds.

A case is a shape and a dtype (`CASES`: SmolLM2-135M's shape in float32 and bfloat16, a 1B Llama's in bfloat16).
The random model is built once, saved in the case's dtype and exported by paradecode-export in that dtype;
transformers loads the saved model, so both decode the same weights. `--prepare` does only that (CPU work), so
`tools/gpu_measure.sh peers` makes the next case's model and export while one is measured. Three modes, on one
prompt of PROMPT_TOKENS ids, each first run once at full length (where it compiles: its time is reported), then
interleaved, `repeat` times each after the harness's warm-up (`tools/harness.py`):

- `hf static`: `model.generate(..., cache_implementation="static")`, greedy. On CUDA transformers compiles the
  forward itself (torch.compile, CUDA graphs); on a CPU it does not unless asked (`--hf-compile on`), and where
  its compilation fails the mode runs uncompiled, the output says so.
- `ar`: paradecode's plain decoding, torch backend, compiled with `--compile` (else eager).
- `paradecode defaults`: ParaDecode with the runtime's defaults (on CUDA: prompt lookup, no exit heads). On
  random weights the output often repeats a token, which lookup then proposes right: its speed here says what
  the verification path costs, not what a real model gains.

Tokens/s is a generate call's new tokens over its whole time, synchronised (the prefill of the short prompt
included, alike for every mode). The bounds, in tokens/s, are the weight bytes a plain decode step reads
(`weight_bytes_per_token`) over a measured rate: the copy bound over the device-to-device copy rate (as
`paradecode-characterise` and `-bench` report it; a copy's reads and writes share the bandwidth) and the read
bound over the measured read rate (`read_bandwidth`: weights read once per token).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import UserInputError, run_command
from paradecode.tools.characterise import LlamaShape, random_llama
from paradecode.tools.harness import Mode, Results, Sample

logger = logging.getLogger("paradecode.peer_shapes")

PROMPT_TOKENS = 32
SLACK_TOKENS = 16  # cache slots past the prompt and new tokens: a verification may write a few positions ahead
HF_COMPILE = ("auto", "on", "off")


SMOLLM2 = LlamaShape(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, vocab=49152)
LLAMA_1B = LlamaShape(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, vocab=128256)
CASES: dict[str, tuple[LlamaShape, str]] = {
    "smollm2-fp32": (SMOLLM2, "float32"),
    "smollm2-bf16": (SMOLLM2, "bfloat16"),
    "1b-bf16": (LLAMA_1B, "bfloat16"),
}


def bound(bytes_per_second: float, weight_bytes: int) -> float:
    """Tokens/s of a decode that does nothing but read `weight_bytes` at `bytes_per_second`."""
    if weight_bytes <= 0 or bytes_per_second <= 0:
        raise ValueError(f"a bound needs positive bytes and rate, got {weight_bytes} bytes at {bytes_per_second} B/s")
    return bytes_per_second / weight_bytes


def bounds(weight_bytes: int, copy_rate: float, read_rates: dict[str, float]) -> dict[str, Any]:
    """The copy bound and the read bound (over the fastest read measured), tokens/s, with the rates they use."""
    read_rate = max(read_rates.values())
    return {
        "weight_bytes_per_token": weight_bytes,
        "copy_gb_s": copy_rate / 1e9,
        "read_gb_s": {name: rate / 1e9 for name, rate in read_rates.items()},
        "copy_tokens_per_second": bound(copy_rate, weight_bytes),
        "read_tokens_per_second": bound(read_rate, weight_bytes),
    }


def mode_row(results: Results, name: str, reference: str, limits: dict[str, Any]) -> dict[str, Any]:
    """One mode's figures: tokens/s (median, min, max over repeats), the ratio to `reference` (per repeat) and the
    median's share of each bound."""
    rate = results.tokens_per_second(name)
    ratio = results.speedup(name, reference)
    runs = results.runs(name)
    return {
        "tokens_per_second": rate.as_dict(),
        f"vs_{reference.replace(' ', '_')}": None if ratio is None else ratio.as_dict(),
        "share_of_copy_bound": rate.median / limits["copy_tokens_per_second"],
        "share_of_read_bound": rate.median / limits["read_tokens_per_second"],
        "new_tokens": [len(s.token_ids) for s in runs],
        "lookup_proposed": sum(s.lookup_proposed for s in runs),
        "lookup_accepted": sum(s.lookup_accepted for s in runs),
    }


def table(payload: dict[str, Any]) -> str:
    """The case's figures as a Markdown table, under a line naming the case and its bounds."""
    limits = payload["bounds"]
    lines = [
        f"{payload['case']}: {payload['shape']}, {payload['dtype']} on {payload['device']}; "
        f"{limits['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token; copy bound "
        f"{limits['copy_tokens_per_second']:.1f} tokens/s ({limits['copy_gb_s']:.0f} GB/s copied), read bound "
        f"{limits['read_tokens_per_second']:.1f} tokens/s ({max(limits['read_gb_s'].values()):.0f} GB/s read)",
        "",
        "| mode | tok/s (min-max) | vs hf static (min-max) | % copy bound | % read bound | first generate s |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, row in payload["modes"].items():
        rate, ratio = row["tokens_per_second"], row["vs_hf_static"]
        versus = "-" if ratio is None else f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
        lines.append(
            f"| {name} | {rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) | {versus} | "
            f"{100 * row['share_of_copy_bound']:.0f}% | {100 * row['share_of_read_bound']:.0f}% | "
            f"{row['first_generate_seconds']:.1f} |"
        )
    lines += ["", *payload["notes"]]
    return "\n".join(lines)


def timed_mode(name: str, kind: str, generate: Callable[[list[int], int], Any]) -> Mode:
    """A mode timed over the whole call: `generate(prompt_ids, max_new_tokens)` returns the new token ids, or a
    paradecode result (whose lookup figures the sample keeps)."""

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        began = time.perf_counter()
        out = generate(prompt_ids, max_new_tokens)
        seconds = time.perf_counter() - began
        tokens = out if isinstance(out, list) else out.token_ids
        stats = {} if isinstance(out, list) else {"lookup_proposed": out.stats.lookup_proposed}
        if stats:
            stats["lookup_accepted"] = out.stats.lookup_accepted
        return Sample(token_ids=tokens, tokens_per_second=len(tokens) / seconds, **stats)

    return Mode(name, kind, run)


class HfStatic:
    """transformers' `generate` with its static cache, greedy, for every new token asked (no EOS stop).

    `compile`: `auto`, transformers' own choice (it compiles on CUDA, not on a CPU); `on`, compiled on any device;
    `off`, never. `first(prompt_ids, max_new_tokens)` makes the first call, where it compiles; if compiling raised
    there (and only then), it falls back to no compilation and `note` says why.
    """

    def __init__(self, model, device: str, compile: str):
        self.model, self.device, self.compile = model, device, compile
        model.generation_config.eos_token_id = None  # random weights: decode every token asked for
        self.note = ""
        self.compiled = False

    def options(self) -> dict[str, Any]:
        if self.compile == "off":
            return {"disable_compile": True}
        if self.compile == "on":
            from transformers import CompileConfig

            config = CompileConfig()
            config._compile_all_devices = True  # transformers' switch to compile on a CPU too (its tests use it)
            return {"compile_config": config}
        return {}

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        import torch

        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids], device=self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
                **self.options(),
            )
        return out[0, len(prompt_ids) :].tolist()

    def first(self, prompt_ids: list[int], max_new_tokens: int) -> float:
        """The first call's seconds; records whether it compiled."""
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        began = time.perf_counter()
        try:
            self(prompt_ids, max_new_tokens)
        except Exception as err:  # reported in the output and the log, then measured uncompiled
            if self.compile == "off":
                raise
            self.note = f"compiling failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}): run uncompiled"
            logger.warning("hf static: %s", self.note)
            self.compile = "off"
            began = time.perf_counter()
            self(prompt_ids, max_new_tokens)
        self.compiled = self.compile != "off" and counters["stats"]["unique_graphs"] > graphs
        return time.perf_counter() - began


@dataclass(frozen=True)
class Settings:
    device: str = "cuda"
    repeat: int = 3
    max_new_tokens: int = 128
    torch_compile: bool = False  # paradecode's modules (--compile)
    hf_compile: str = "auto"

    def __post_init__(self) -> None:
        if self.repeat < 1 or self.max_new_tokens < 2:
            raise UserInputError(
                f"--repeat {self.repeat} / --max-new-tokens {self.max_new_tokens}: need at least 1 and 2."
            )
        if self.hf_compile not in HF_COMPILE:
            raise UserInputError(f"--hf-compile {self.hf_compile!r}: expected one of {', '.join(HF_COMPILE)}.")


def prepare(case: str, shape: LlamaShape, dtype: str, new_tokens: int, work: Path) -> float | None:
    """The case's random model (`work/model`, saved in `dtype`) and its export (`work/export`), built unless `work`
    holds them already (the same shape and dtype, room for `new_tokens`). Returns the seconds taken, None where
    nothing was to do. CPU work only: `gpu_measure.sh peers` prepares the next case while one is measured."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.graphs.manifest import read_manifest

    length = PROMPT_TOKENS + new_tokens + SLACK_TOKENS
    if (work / "export" / "manifest.json").is_file() and (work / "model" / "config.json").is_file():
        manifest = read_manifest(work / "export")
        made = (manifest.spec.hidden_size, manifest.spec.num_layers, manifest.spec.vocab_size, manifest.dtype)
        if made == (shape.hidden, shape.layers, shape.vocab, dtype) and manifest.max_seq_len >= length:
            logger.info("%s: the model and export in %s are this case's", case, work)
            return None
    began = time.perf_counter()
    logger.info("%s: a random Llama %s in %s", case, shape, dtype)
    random_llama(shape, dtype).save_pretrained(work / "model")
    logger.info("%s: built and saved in %.1f s; exporting", case, time.perf_counter() - began)
    export_model(
        ExportConfig(model=str(work / "model"), output=work / "export", dtype=dtype, max_seq_len=length, force=True)
    )
    seconds = time.perf_counter() - began
    logger.info("%s: built and exported in %.1f s", case, seconds)
    return seconds


def measure_case(case: str, shape: LlamaShape, dtype: str, settings: Settings, work: Path) -> dict[str, Any]:
    """Prepare (where not done) and measure one case; the payload `table` prints and the JSON holds."""
    import torch
    from transformers import LlamaForCausalLM

    from paradecode.runtime import load
    from paradecode.tools import bench_modes as bm
    from paradecode.tools import harness

    device, new_tokens = settings.device, settings.max_new_tokens
    began = time.perf_counter()
    prepared = prepare(case, shape, dtype, new_tokens, work)
    hf_model = LlamaForCausalLM.from_pretrained(str(work / "model"), dtype=getattr(torch, dtype)).eval()
    prompt = [(17 * i + 5) % shape.vocab for i in range(PROMPT_TOKENS)]
    hf = HfStatic(hf_model.to(device), device, settings.hf_compile)
    with load(
        work / "export", backend="torch", device=device, torch_compile=settings.torch_compile, verify=False
    ) as pd:
        limits = bounds(
            bm.weight_bytes_per_token(work / "export"), bm.copy_bandwidth(device), bm.read_bandwidth(device, dtype)
        )
        logger.info(
            "%s: %.1f MB of weights per token; copy bound %.1f tokens/s, read bound %.1f tokens/s",
            case,
            limits["weight_bytes_per_token"] / 1e6,
            limits["copy_tokens_per_second"],
            limits["read_tokens_per_second"],
        )
        modes = [
            timed_mode("hf static", "hf", hf),
            timed_mode(
                "ar", "ar", lambda p, n: pd.generate(prompt_ids=p, max_new_tokens=n, mode="ar", ignore_eos=True)
            ),
            timed_mode(
                "paradecode defaults",
                "paradecode",
                lambda p, n: pd.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True),
            ),
        ]
        # Each mode's first generate at full length, where it compiles (paradecode's first: its counts of Inductor's
        # cache are its own); the harness's warm-up at the same length then compiles nothing more (a static cache of
        # another length would be another shape to transformers' compiled forward).
        # paradecode's modes are measured first, then transformers': on an H200 (2026-11-27), paradecode's CUDA-graph
        # calls made after transformers' compiled generate (its CUDA graphs) in the same process failed with illegal
        # memory accesses, twice in three cases, so the two are not interleaved (each side's own modes are).
        first: dict[str, float] = {}
        compiling = bm.first_compile(pd, prompt, new_tokens) if settings.torch_compile else None
        if compiling is not None:
            first["ar"] = compiling["first_generate_seconds"]
            logger.info("%s: %s", case, bm.compile_line(compiling))
        for mode in [m for m in modes[1:] if m.name not in first]:
            started = time.perf_counter()
            mode.run(prompt, new_tokens)
            first[mode.name] = time.perf_counter() - started
        settings_of = dict(max_new_tokens=new_tokens, repeat=settings.repeat, warmup_tokens=new_tokens)
        ours = harness.measure(modes[1:], [prompt], **settings_of)
        first["hf static"] = hf.first(prompt, new_tokens)
        for name, seconds in first.items():
            logger.info("%s: %s's first generate %.1f s", case, name, seconds)
        logger.info("%s: hf static compiled: %s%s", case, hf.compiled, f" ({hf.note})" if hf.note else "")
        theirs = harness.measure(modes[:1], [prompt], **settings_of)
        results = harness.Results(modes, ours.samples + theirs.samples)
        reference = {s.repeat: s.token_ids for s in results.runs("ar")}
        same = all(s.token_ids == reference[s.repeat] for s in results.runs("paradecode defaults"))
    rows = {}
    for mode in modes:
        rows[mode.name] = {
            **mode_row(results, mode.name, "hf static", limits),
            "first_generate_seconds": first[mode.name],
        }
        logger.info(
            "%s: %-19s %7.1f tokens/s, %.2fx hf static, %.0f%% of the copy bound, %.0f%% of the read bound",
            case,
            mode.name,
            rows[mode.name]["tokens_per_second"]["median"],
            rows[mode.name]["vs_hf_static"]["median"],
            100 * rows[mode.name]["share_of_copy_bound"],
            100 * rows[mode.name]["share_of_read_bound"],
        )
    notes = [
        "tokens/s: new tokens over a whole generate call (prefill of a "
        f"{PROMPT_TOKENS}-token prompt included), median of {settings.repeat} (min-max); paradecode's modes "
        "interleaved, then hf static's (not interleaved with them: see measure_case)",
        f"hf static: {'compiled' if hf.compiled else 'not compiled'} (--hf-compile {settings.hf_compile})"
        + (f"; {hf.note}" if hf.note else ""),
        f"ar and paradecode defaults: torch backend, {'compiled' if settings.torch_compile else 'eager'}; "
        f"paradecode defaults {'gave' if same else 'did NOT give'} ar's tokens; random weights: lookup proposes "
        "what the model repeats",
    ]
    return {
        "case": case,
        "shape": asdict(shape),
        "dtype": dtype,
        "device": device,
        "settings": asdict(settings),
        "prompt_tokens": PROMPT_TOKENS,
        "prepare_seconds": prepared,  # building and exporting; None: done before (--prepare)
        "bounds": limits,
        "hf_static": {"compiled": hf.compiled, "note": hf.note, "compile_option": settings.hf_compile},
        "paradecode_compile": compiling,
        "paradecode_defaults_same_tokens_as_ar": same,
        "modes": rows,
        "notes": notes,
        "seconds": time.perf_counter() - began,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/lab/peer_shapes.py", description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=tuple(CASES), help="the shape and dtype")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=Settings.device)
    parser.add_argument("--repeat", type=int, default=Settings.repeat, metavar="R")
    parser.add_argument("--max-new-tokens", type=int, default=Settings.max_new_tokens, metavar="N")
    parser.add_argument(
        "--compile",
        dest="torch_compile",
        action="store_true",
        help="torch backend: compile paradecode's modules with torch.compile (its GPU fast path; default: eager)",
    )
    parser.add_argument(
        "--hf-compile",
        choices=HF_COMPILE,
        default=Settings.hf_compile,
        help="auto: transformers' own choice (compiled on CUDA, not on a CPU); on: compiled on any device; off: never",
    )
    parser.add_argument("--json", type=Path, metavar="OUT")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep the model and export here, and use those already there (default: a temporary folder)",
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="only build the random model and export it into --work-dir (CPU work), for a later run to measure",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    def work() -> str:
        from paradecode.export.cli import quiet_dependency_logs
        from paradecode.export.files import check_file_writable
        from paradecode.tools.bench_modes import machine
        from paradecode.tools.reporting import save_json

        quiet_dependency_logs()  # the exporter's and transformers' chatter
        if args.json is not None:
            check_file_writable(args.json, "--json")
        settings = Settings(
            device=args.device,
            repeat=args.repeat,
            max_new_tokens=args.max_new_tokens,
            torch_compile=args.torch_compile,
            hf_compile=args.hf_compile,
        )
        shape, dtype = CASES[args.case]
        if args.prepare:
            if args.work_dir is None:
                raise UserInputError("--prepare writes the model and export into --work-dir: give one.")
            seconds = prepare(args.case, shape, dtype, settings.max_new_tokens, args.work_dir)
            return f"{args.case}: prepared in {args.work_dir}" + (" (already there)" if seconds is None else "")
        with tempfile.TemporaryDirectory(prefix="paradecode-peers-") as tmp:
            payload = measure_case(args.case, shape, dtype, settings, args.work_dir or Path(tmp))
        if args.json is not None:
            save_json(args.json, {**payload, "machine": machine()})
        return table(payload)

    code, text = run_command("peer_shapes", work)
    if code == 0:
        print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
