"""`paradecode-generate DIR`: decode with an export from the command line.

Without --json the text is streamed as tokens are verified and a summary goes to stderr; with
--json one JSON object is printed: {"token_ids": [...new tokens...], "text": ..., "stats": {...}}.
Exit codes: 0 done, 2 bad input or a bad export, 3 a missing backend or device, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from paradecode.graphs.errors import UserInputError, run_command


def id_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paradecode-generate",
        description="Generate text with a paradecode export, with plain greedy decoding "
        "(ar) or ParaDecode (same tokens, early exits).",
    )
    parser.add_argument("export", metavar="DIR", help="a folder written by paradecode-export")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text (needs the export's tokenizer)")
    prompt.add_argument("--prompt-ids", type=id_list, metavar="1,2,3", help="the prompt as token ids")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="new tokens to generate (default 64)"
    )
    parser.add_argument("--mode", choices=("ar", "paradecode"), default="paradecode", help="default paradecode")
    parser.add_argument(
        "--overlap",
        choices=("auto", "streams", "batched", "both"),
        default="auto",
        help="how pending layers are completed: on another lane at once (streams), batched with later "
        "tokens (batched), or both; auto (default): batched on a CPU, both on CUDA",
    )
    parser.add_argument(
        "--threshold",
        metavar="G",
        help="exit threshold for every exit layer, in [0, 1], or 'never' (default: the export's)",
    )
    parser.add_argument("--max-unverified", type=int, default=5, metavar="K", help="most unverified tokens (default 5)")
    parser.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"), default="onnxruntime")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--lanes", type=int, default=2, help="concurrent lanes, the calling thread included (default 2)"
    )
    parser.add_argument("--threads", type=int, help="onnxruntime threads per call (default: cores / lanes)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-sequence token")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--no-verify", action="store_true", help="skip checking the export's file hashes on load")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="paradecode-generate: %(message)s", stream=sys.stderr)
    from paradecode.runtime.config import GenerationConfig, parse_threshold
    from paradecode.runtime.model import ParaDecodeModel

    def work():
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            mode=args.mode,
            overlap=args.overlap,
            thresholds=parse_threshold(args.threshold) if args.threshold is not None else None,
            max_unverified=args.max_unverified,
            ignore_eos=args.ignore_eos,
        )
        with ParaDecodeModel(
            args.export,
            backend=args.backend,
            device=args.device,
            lanes=args.lanes,
            threads=args.threads,
            verify=not args.no_verify,
        ) as model:
            if args.prompt is not None and model.tokenizer is None:
                raise UserInputError(f"{args.export} has no tokenizer: use --prompt-ids.")
            stream = model.stream(args.prompt, prompt_ids=args.prompt_ids, config=config)
            for piece in stream:
                if not args.json:
                    sys.stdout.write(piece.text if model.tokenizer else f"{piece.token} ")
                    sys.stdout.flush()
            return stream.result

    code, result = run_command("paradecode-generate", work)
    if code:
        return code
    stats = result.stats
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        exits = (
            ", ".join(
                f"layer {e}: {n} ({stats.accepted_per_layer.get(e, 0)} accepted)"
                for e, n in sorted(stats.exits_per_layer.items())
            )
            or "none"
        )
        print(
            f"[{stats.mode}{'/' + stats.overlap if stats.overlap else ''}] {stats.new_tokens} tokens, "
            f"{stats.tokens_per_second:.1f} tokens/s, early exits: {exits}, rollbacks: {stats.rollbacks}, "
            f"stopped by {stats.stop_reason}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
