"""`paradecode-bench DIR`: ar vs ParaDecode vs Hugging Face generate (and, with --peers, onnxruntime-genai,
llama.cpp and OpenVINO GenAI), side by side, on one machine.

Prints a Markdown table and writes the JSON (--json) and a PNG (--plot): speedup against the
threshold per overlap mode, with the peers' and Hugging Face's speedups as reference lines, and early
exits per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import math
import sys
from contextlib import ExitStack
from pathlib import Path

from paradecode.export.prompt_sets import NAMES_HELP
from paradecode.graphs.arguments import temperature
from paradecode.graphs.errors import UserInputError, run_command
from paradecode.runtime.backends import BACKENDS
from paradecode.runtime.config import ADAPTIVE, OVERLAPS, GenerationConfig
from paradecode.runtime.decoding_flags import add_decoding_flags, help_of
from paradecode.tools.options import choice_list
from paradecode.tools.peers import OPENVINO_WEIGHTS, PEERS, PRECISIONS, PeerSettings

logger = logging.getLogger("paradecode.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradecode-bench", description=__doc__.splitlines()[0])
    parser.add_argument("export", metavar="DIR", help="a folder written by paradecode-export")
    parser.add_argument(
        "--prompts",
        metavar="FILE|NAME",
        help='one prompt per line (\\n for a newline), or a .jsonl file of {"prompt": ...} or {"messages": [...]} '
        f"lines (a chat, rendered with the export's chat template), {NAMES_HELP}; default: eval where the export "
        "has a chat template, else built-in code and prose prompts",
    )
    parser.add_argument(
        "--per-category",
        type=int,
        metavar="N",
        help="keep only the first N prompts of each category (categories, then files, keep their order)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--repeat", type=int, default=3, metavar="R", help="repeats of every prompt (default 3)")
    parser.add_argument(
        "--hf",
        metavar="MODEL",
        help="the original model for the Hugging Face reference: a folder, a .gguf file, a Hub id or a known "
        "short name (default: the manifest's source, where it is a local folder, a .gguf file or a known name)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face modes")
    parser.add_argument(
        "--hf-modes",
        type=choice_list(HF_MODES, "--hf-modes"),
        default=",".join(HF_MODES),
        help=f"which Hugging Face modes to run, from {', '.join(HF_MODES)} (default all)",
    )
    parser.add_argument(
        "--peers",
        type=choice_list(PEERS, "--peers"),
        metavar="NAME,NAME",
        help="the ecosystem's runtimes to measure beside ar and ParaDecode, greedy, on the same prompt ids, "
        "interleaved, each with every core: ort-genai (onnxruntime-genai on its model builder's model of the same "
        "source, plain and with its n-gram speculation), llama.cpp (llama-cpp-python on the GGUF file) and openvino "
        "(OpenVINO GenAI on optimum-intel's conversion of the same source, plain and with its prompt lookup); "
        "needs `pip install 'paradecode[peers]'`",
    )
    parser.add_argument(
        "--peer-precision",
        choices=PRECISIONS,
        default="int4",
        help="the weights onnxruntime-genai's model builder writes (default int4)",
    )
    parser.add_argument(
        "--openvino-weights",
        choices=OPENVINO_WEIGHTS,
        default=PeerSettings.openvino_weights,
        help=f"the weights optimum-intel writes for OpenVINO (default {PeerSettings.openvino_weights}): int8 beside "
        "the default export, int4 (groups of 32) beside --weights int4, fp32 to check against transformers",
    )
    parser.add_argument(
        "--openvino-converter",
        type=Path,
        metavar="PYTHON",
        help="a Python that has optimum-intel, which converts the model for the openvino peer (default: this one where "
        "it has it, else an environment of its own made once in --peer-cache: optimum-intel 2.2 requires "
        "transformers < 5.6)",
    )
    parser.add_argument(
        "--peer-source",
        metavar="MODEL",
        help="the original model the peers run, as paradecode-export takes it (a folder, a .gguf file or a known "
        "short name such as smollm2; default: the manifest's source, where it is on this machine)",
    )
    parser.add_argument(
        "--peer-cache",
        type=Path,
        metavar="DIR",
        help="where onnxruntime-genai's and OpenVINO's models are made once and kept (default "
        "~/.cache/paradecode/peers)",
    )
    parser.add_argument(
        "--compare-export",
        type=Path,
        action="append",
        default=[],
        metavar="DIR2",
        help="another export of the same model (say its --weights float export beside a quantized one): its ar, in "
        "both thread settings, is measured beside the others, interleaved, and reported as reference rows "
        "(repeat the option for several)",
    )
    parser.add_argument(
        "--thresholds",
        default="default,0.5,0.75,0.9",
        help="comma-separated thresholds to try; 'default' = the export's (calibrated) ones",
    )
    parser.add_argument(
        "--overlaps",
        type=choice_list(OVERLAPS, "--overlaps"),
        default="batched,streams,both",
        help=f"comma-separated overlap modes to try, from {', '.join(OVERLAPS)} (default batched,streams,both)",
    )
    parser.add_argument(
        "--lookup",
        default=str(GenerationConfig.lookup_tokens),
        metavar="N1,N2",
        help=f"values to try of: {help_of('--lookup')}; each threshold and overlap runs once per value",
    )
    parser.add_argument(
        "--lookup-ngram",
        default=str(GenerationConfig.lookup_max_ngram),
        metavar="N1,N2",
        help=f"values to try of: {help_of('--lookup-ngram')}; each lookup setting runs once per value",
    )
    parser.add_argument(
        "--lookup-length-factor",
        default=f"{GenerationConfig.lookup_length_factor:g}",
        metavar="F1,F2",
        help=f"values to try of: {help_of('--lookup-length-factor')}; each lookup setting runs once per value",
    )
    parser.add_argument(
        "--draft-tokens",
        default="0",
        metavar="N1,N2",
        help=f"values to try of: {help_of('--draft-tokens')}; each lookup setting runs once per value",
    )
    parser.add_argument(
        "--adaptive",
        type=choice_list(ADAPTIVE, "--adaptive"),
        default="auto",
        help=f"values to try of: {help_of('--adaptive')}; each threshold, overlap and lookup setting runs once per "
        "value",
    )
    parser.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        metavar="T",
        help="sample at this temperature in every mode, each run seeded by its prompt and repeat (default 0: greedy)",
    )
    add_decoding_flags(parser, ["--max-unverified"], defaults={"--max-unverified": GenerationConfig.max_unverified})
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="onnxruntime")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch backend: compile every subgraph module with torch.compile; ar also runs uncompiled ('ar (eager)')",
    )
    parser.add_argument(
        "--int4-kernels",
        action="store_true",
        help="torch backend: read the export's 4-bit weights with torch's int4 kernels; ar also runs on the same "
        "export dequantized ('ar (dequantized)', instead of 'ar (eager)')",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure and sample as JSON")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="write the speedup and exits plot")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, outcome = run_command("paradecode-bench", lambda: run(args), "interrupted; nothing was written")
    if code != 0:
        return code
    table, unwritten = outcome
    print(table)
    for message in unwritten:
        print(f"paradecode-bench: error: {message}", file=sys.stderr)
    return 1 if unwritten else 0


def parse_counts(text: str, option: str) -> list[int]:
    """Comma-separated non-negative integers (--lookup, --draft-tokens)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise UserInputError(f"{option} {text!r}: expected comma-separated non-negative integers such as 0,4.")
    return values


def lookup_variants(args) -> tuple[list[tuple[int, int, float]], bool]:
    """The (lookup tokens, longest match, length factor) settings to run, and whether the match settings vary
    (then they are named in the modes' names). They vary only where lookup is on."""
    lookups = parse_counts(args.lookup, "--lookup")
    matches = parse_numbers(args.lookup_ngram, "--lookup-ngram", int)
    factors = parse_numbers(args.lookup_length_factor, "--lookup-length-factor", float)
    variants = [
        (lookup, match, factor)
        for lookup in lookups
        for match, factor in (itertools.product(matches, factors) if lookup else [(matches[0], factors[0])])
    ]
    for lookup, match, factor in variants:  # the runtime's own checks (a match shorter than the shortest, say)
        if not lookup:
            continue  # lookup off: its match settings are not used
        try:
            GenerationConfig(lookup_tokens=lookup, lookup_max_ngram=match, lookup_length_factor=factor)
        except UserInputError as err:
            raise UserInputError(f"--lookup-ngram {match} / --lookup-length-factor {factor:g}: {err}") from None
    return variants, len(matches) > 1 or len(factors) > 1


def parse_numbers(text: str, option: str, kind: type) -> list:
    """Comma-separated positive numbers of `kind` (int or float; a float may be inf)."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        what = "positive integers such as 3,16" if kind is int else "positive numbers such as 1,inf"
        raise UserInputError(f"{option} {text!r}: expected comma-separated {what}.")
    return values


def parse_thresholds(text: str) -> list[float | None]:
    from paradecode.runtime.config import check_threshold, parse_threshold

    values: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        values.append(None if part == "default" else check_threshold(parse_threshold(part)))
    return values


def run(args) -> tuple[str, list[str]]:
    """(the Markdown report, what could not be written at the end: --json, --plot)."""
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.tools.bench_modes import opened_with_ar_baselines
    from paradecode.tools.reporting import check_outputs, check_plotting

    if args.repeat < 1 or args.max_new_tokens < 2:
        raise UserInputError("--repeat must be at least 1 and --max-new-tokens at least 2.")
    check_outputs({"--json": args.json, "--plot": args.plot})  # before the run: they are written at its end
    if args.plot is not None:
        check_plotting()
    thresholds = parse_thresholds(args.thresholds)
    lookup_variants(args)  # refused before anything loads
    peers = peer_settings(args)
    prompts = load_prompts(args.prompts) if args.prompts else None
    with (
        opened_with_ar_baselines(
            args.export,
            backend=args.backend,
            device=args.device,
            torch_compile=args.compile,
            int4_kernels=args.int4_kernels,
        ) as (
            main_model,
            ar_models,
        ),
        ExitStack() as peer_runners,
    ):
        if prompts is None:
            prompts = default_prompts(main_model)
        if args.per_category is not None:
            prompts = first_of_each_category(prompts, args.per_category)
        extra = []
        for other in args.compare_export:
            extra += compared_export_modes(args, other, main_model, peer_runners)
        if peers is not None:
            from paradecode.tools.peers import peer_modes

            extra += peer_modes(peers, main_model, peer_runners, ignore_eos=args.ignore_eos)
        return measure(args, prompts, thresholds, main_model, ar_models, extra)


def compared_export_modes(args, export: Path, main_model, stack: ExitStack) -> list:
    """ar on `export` (a --compare-export), in each thread setting the main export's ar runs in, as reference rows
    (kind "peer": another engine's plain decoding, not a baseline). Its models are closed with `stack`."""
    from paradecode.tools import bench_modes as bm

    other, baselines = stack.enter_context(
        bm.opened_with_ar_baselines(export, backend=args.backend, device=args.device)
    )
    ours, theirs = main_model.manifest.model, other.manifest.model
    if ours.get("weights_sha256") != theirs.get("weights_sha256"):
        raise UserInputError(
            f"--compare-export {export} was exported from another model than {args.export} (weights "
            f"sha256 {str(theirs.get('weights_sha256'))[:12]}..., this export's {str(ours.get('weights_sha256'))[:12]}"
            "...): the same prompts would not mean the same tokens. Compare two exports of one model."
        )
    name = Path(export).name
    sampling = {"temperature": args.temperature, "seed": 0} if args.temperature else {}
    return [
        dataclasses.replace(
            bm.stream_mode(f"{label} of {name}", model, {"mode": "ar", **sampling}, ignore_eos=args.ignore_eos),
            kind="peer",
        )
        for label, model in baselines.items()
    ]


def peer_settings(args):
    """--peers and its options as PeerSettings (None without --peers), checked before anything is loaded."""
    from paradecode.tools.peers import check_peer_packages

    if not args.peers:
        options = {
            "--peer-source": args.peer_source,
            "--peer-cache": args.peer_cache,
            "--openvino-converter": args.openvino_converter,
        }
        given = [flag for flag, value in options.items() if value]
        if given:
            raise UserInputError(f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} up --peers: add --peers.")
        return None
    if args.temperature:
        raise UserInputError(
            f"--peers compares greedy decoding, and --temperature {args.temperature:g} samples: drop one of them."
        )
    if args.device != "cpu":
        raise UserInputError(f"--peers runs the peers on the CPU, and --device is {args.device}: use --device cpu.")
    check_peer_packages(args.peers)
    cache = {"cache": args.peer_cache} if args.peer_cache else {}
    return PeerSettings(
        args.peers,
        precision=args.peer_precision,
        source=args.peer_source,
        openvino_weights=args.openvino_weights,
        openvino_converter=args.openvino_converter,
        **cache,
    )


def first_of_each_category(prompts: list, count: int) -> list:
    """The first `count` prompts of each category, in the order given."""
    if count < 1:
        raise UserInputError(f"--per-category must be at least 1, got {count}.")
    seen: dict = {}
    kept = []
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if seen[prompt.category] <= count:
            kept.append(prompt)
    return kept


def default_prompts(model) -> list:
    """The evaluation set (`eval`) where the export has a chat template, else the built-in text prompts."""
    from paradecode.export.prompt_files import LabelledPrompt
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.tools.bench_modes import DEFAULT_PROMPTS

    if model.chat_template is not None:
        logger.info("prompts: the evaluation set (eval), as the export has a chat template")
        return load_prompts("eval")
    logger.info("prompts: the built-in text prompts, as the export has no chat template")
    return [LabelledPrompt(text) for text in DEFAULT_PROMPTS]


def prompt_ids_of(model, prompts: list) -> list[list[int]]:
    """Every prompt's token ids, as every mode (the Hugging Face ones included) receives them.

    A text gets the tokenizer's special tokens; a chat (a list of messages) is rendered with the
    export's chat template and encoded as it is, as transformers' `apply_chat_template` does.
    """
    if model.tokenizer is None:
        raise UserInputError(f"{model.export.path} has no tokenizer: the benchmark needs text or chat prompts.")
    ids = []
    for number, prompt in enumerate(prompts, 1):
        try:
            ids.append(model.prompt_ids(prompt) if isinstance(prompt, str) else model.prompt_ids(messages=prompt))
        except UserInputError as err:
            raise UserInputError(f"prompt {number} (of {len(prompts)}): {err}") from err
    return ids


def measure(args, labelled: list, thresholds, main_model, ar_models, extra_modes=()) -> tuple[str, list[str]]:
    """Measure every mode (`extra_modes`, such as the peers', after the others) and write the report: (the Markdown
    report, what could not be written)."""
    from paradecode.export.heads.call_costs import measure_call_costs
    from paradecode.tools import bench_modes as bm
    from paradecode.tools import harness
    from paradecode.tools.reporting import benchmark_figure, markdown_report, save_figure, save_json, save_outputs

    manifest = main_model.manifest
    texts = [p.prompt for p in labelled]
    prompts = prompt_ids_of(main_model, texts)
    ignore = args.ignore_eos
    variants, named_match = lookup_variants(args)
    drafts = parse_counts(args.draft_tokens, "--draft-tokens")
    if any(drafts) and manifest.draft is None:
        raise UserInputError(
            f"--draft-tokens {args.draft_tokens}: {args.export} has no draft head; export one with "
            "paradecode-export --draft-head FILE, or leave --draft-tokens at 0."
        )
    # one seed for every run: draws are keyed by (seed, position, purpose), so the ar rows sample alike
    sampling = {"temperature": args.temperature, "seed": 0} if args.temperature else {}
    modes = [bm.stream_mode(label, m, {"mode": "ar", **sampling}, ignore_eos=ignore) for label, m in ar_models.items()]
    # the dequantized weights beside int4 kernels: another engine's plain decoding, a reference row, not a baseline
    modes = [dataclasses.replace(m, kind="peer") if m.name == bm.DEQUANTIZED else m for m in modes]
    for overlap in args.overlaps:
        for threshold in thresholds:
            for (lookup, match, factor), drafted, adaptive in itertools.product(variants, drafts, args.adaptive):
                label = "default" if threshold is None else ("never" if math.isinf(threshold) else f"{threshold:g}")
                settings = {
                    "mode": "paradecode",
                    "overlap": overlap,
                    "thresholds": threshold,
                    "max_unverified": args.max_unverified,
                    "lookup_tokens": lookup,
                    "lookup_max_ngram": match,
                    "lookup_length_factor": factor,
                    "draft_tokens": drafted,
                    "adaptive": ADAPTIVE[adaptive],
                    **sampling,
                }
                name = f"paradecode {overlap} {label}" + (f" +lookup{lookup}" if lookup else "")
                name += f" (match {match}, x{factor:g})" if lookup and named_match else ""
                name += f" +draft{drafted}" if drafted else ""
                name += f" adaptive {adaptive}" if len(args.adaptive) > 1 or adaptive != "auto" else ""
                config = GenerationConfig(**{k: v for k, v in settings.items() if k != "mode"})
                if config.skips_exits(main_model.backend.device.type, main_model.overlap_of(config)):
                    name += " (no exit heads)"  # what `default` with adaptive auto means there
                modes.append(bm.stream_mode(name, main_model, settings, ignore_eos=ignore))
    hf_path = None if args.no_hf else (args.hf or local_source(manifest))
    if hf_path is not None:
        modes += hf_modes(hf_path, manifest, ignore, args.temperature, args.hf_modes, device=args.device)
    modes += extra_modes
    compiling = None
    if args.compile:  # before any mode runs: the first generate is where the modules compile
        compiling = bm.first_compile(main_model, prompts[0])
        logger.info("%s", bm.compile_line(compiling))
    logger.info(
        "benchmarking %d modes x %d prompts x %d repeats, %d new tokens each",
        len(modes),
        len(prompts),
        args.repeat,
        args.max_new_tokens,
    )
    results = harness.measure(modes, prompts, max_new_tokens=args.max_new_tokens, repeat=args.repeat, skip_failing=True)
    # on the model's own cache, as decoding calls them; the next generate starts from an empty cache
    costs = measure_call_costs(main_model.backend, main_model.backend.allocate_cache(), (1, args.max_unverified + 1))
    logger.info("measured call costs: %s", costs.as_dict())

    def bound(mode, accepted: dict, tokens: int) -> float | None:
        """docs/design.md §6's bound for exits alone in `batched` (no lookup, greedy), at the measured acceptance."""
        settings = mode.settings
        if settings.get("overlap") != "batched" or settings.get("lookup_tokens") or args.temperature:
            return None
        active = sorted(e for e, t in main_model.manifest.thresholds.items() if t <= 1)
        if settings.get("thresholds") is not None:
            active = list(main_model.manifest.exit_layers)
        return bm.exit_bound(costs, accepted, tokens, manifest.spec.num_layers, active)

    summary = bm.summarize(results, bound=bound)
    bandwidth = bm.copy_bandwidth(args.device)
    weight_bytes = bm.weight_bytes_per_token(args.export)
    ar_rate = results.tokens_per_second(results.baseline).median
    memory_bound = {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_token": weight_bytes,
        "ar_bound_tokens_per_second": bandwidth / weight_bytes,
        "ar_tokens_per_second": ar_rate,
        "ar_share_of_bound": ar_rate * weight_bytes / bandwidth,
    }
    logger.info(
        "ar (%s): %.1f tokens/s, %.0f%% of the memory-bandwidth bound (%.1f MB of weights per token at %.1f GB/s "
        "measured copy bandwidth = %.1f tokens/s)",
        results.baseline,
        ar_rate,
        100 * memory_bound["ar_share_of_bound"],
        weight_bytes / 1e6,
        bandwidth / 1e9,
        memory_bound["ar_bound_tokens_per_second"],
    )
    by_category = bm.summarize_by_category(results, [p.category for p in labelled], bound=bound)
    table = markdown_report(summary, by_category)
    if compiling is not None:
        table = f"{bm.compile_line(compiling)}\n\n{table}"
    outputs = []
    if args.json:
        report = {
            "export": str(Path(args.export).resolve()),
            "model": manifest.model,
            "machine": bm.machine(),
            "settings": {k: ",".join(v) if isinstance(v, tuple) else str(v) for k, v in vars(args).items()},
            "prompts": texts,
            "call_costs": costs.as_dict(),
            "memory_bound": memory_bound,
            "compile": compiling,
            "summary": summary,
            "categories": by_category,
            "samples": bm.samples_as_dicts(results.samples),
        }
        outputs.append(("--json", args.json, lambda path: save_json(path, report)))
    if args.plot:
        title = f"{Path(args.export).name}: {args.backend} on {args.device}"
        outputs.append(("--plot", args.plot, lambda path: save_figure(path, benchmark_figure(summary, title))))
    return table, save_outputs(outputs)


def local_source(manifest) -> str | None:
    """The manifest's source where it resolves without a download: a folder, a .gguf file or a known name."""
    from paradecode.export.known_models import KNOWN_MODELS

    source = manifest.model.get("source")
    if source and (source in KNOWN_MODELS or Path(source).exists()):
        return source
    logger.info("no local copy of the original model (%s): skipping the Hugging Face modes (pass --hf)", source)
    return None


HF_MODES = ("greedy", "prompt-lookup", "early-exit")


def hf_modes(
    reference: str, manifest, ignore_eos: bool, temperature: float = 0.0, which=HF_MODES, device: str = "cpu"
) -> list:
    """Hugging Face generate on the original model, loaded as paradecode-export loads it, then moved to the
    export's dtype and the benchmark's device (the same weights, precision and hardware as ours)."""
    import torch
    from transformers.utils import logging as hf_logging

    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.source import resolve_model
    from paradecode.tools import bench_modes as bm

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    source = resolve_model(reference)
    model = load_hf_model(source).to(device=device, dtype=getattr(torch, manifest.dtype))
    ours, theirs = source.identity()["weights_sha256"], manifest.model.get("weights_sha256")
    if ours != theirs:
        logger.warning(
            "--hf %s is not the model this export was made from (weights sha256 %s..., the export's %s...): "
            "the hf rows compare another model",
            reference,
            ours[:12],
            str(theirs)[:12],
        )
    early = manifest.exit_layers[0] if manifest.exit_layers else 1
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {}
    modes = {
        "greedy": ("hf", sampling),
        "prompt-lookup": ("hf prompt-lookup", {"prompt_lookup_num_tokens": 10, **sampling}),
        "early-exit": (f"hf early-exit@{early}", {"assistant_early_exit": early, **sampling}),
    }
    return [bm.hf_mode(modes[w][0], model, modes[w][1], ignore_eos=ignore_eos) for w in which]


if __name__ == "__main__":
    sys.exit(main())
