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
from pathlib import Path

from paradecode.graphs.arguments import positive_int, seed, temperature
from paradecode.graphs.errors import UserInputError, run_command

MAX_PROMPT_FILE_BYTES = 16 << 20  # a prompt or chat file; far more text than any export's context holds


def id_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from paradecode.runtime.backends import BACKENDS
    from paradecode.runtime.decoding_flags import add_decoding_flags

    parser = argparse.ArgumentParser(
        prog="paradecode-generate",
        description="Generate text with a paradecode export, with plain greedy decoding "
        "(ar) or ParaDecode (same tokens, early exits).",
    )
    parser.add_argument("export", metavar="DIR", help="a folder written by paradecode-export")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text (needs the export's tokenizer)")
    prompt.add_argument(
        "--prompt-file", type=Path, metavar="FILE", help="read the prompt text from FILE ('-': standard input)"
    )
    prompt.add_argument("--prompt-ids", type=id_list, metavar="1,2,3", help="the prompt as token ids")
    prompt.add_argument(
        "--messages",
        type=Path,
        metavar="FILE",
        help='a chat: a JSON file holding a list of {"role": ..., "content": ...} messages (or an object with '
        "such a \"messages\" list), rendered with the export's chat template ('-': standard input)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the --prompt / --prompt-file text as one user message, rendered with the export's chat template",
    )
    # Settings default to GenerationConfig's own defaults (None here: not given).
    add_decoding_flags(parser)
    parser.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop when the output contains TEXT (repeatable)"
    )
    parser.add_argument(
        "--temperature", type=temperature, metavar="T", help="sample at this temperature, 0 to 2 (default 0: greedy)"
    )
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most probable tokens (0: all)")
    parser.add_argument("--top-p", type=float, metavar="P", help="sample among the most probable tokens of mass P")
    parser.add_argument(
        "--seed",
        type=seed,
        help="seed of the sampling draws, -2**63 to 2**64 - 1 as paradecode-serve takes it (a negative one wraps to "
        "2**64 + seed; default: a random one, reported)",
    )
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="onnxruntime")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--lanes", type=positive_int, default=2, help="concurrent lanes, the calling thread included (default 2)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="onnxruntime threads per call (default: every core)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch backend: compile the model's modules with torch.compile (faster decoding on a GPU once compiled; "
        "the first calls of each shape compile)",
    )
    parser.add_argument(
        "--int4-kernels",
        action="store_true",
        help="torch backend: read an export's 4-bit weights with torch's int4 kernels instead of dequantizing them "
        "(CUDA: bfloat16 products, compute capability 8.0+; ParaDecode then runs as the machine's probe says)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-sequence token")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip hashing the export's other files on load (the files a backend computes with are always read whole "
        "and checked)",
    )
    return parser


def read_prompt_file(path: Path, option: str = "--prompt-file") -> str:
    """The text of `path` ('-': standard input), at most MAX_PROMPT_FILE_BYTES of UTF-8."""
    name = "standard input" if str(path) == "-" else str(path)
    if str(path) == "-":
        data = sys.stdin.buffer.read(MAX_PROMPT_FILE_BYTES + 1)
    elif path.is_dir():
        raise UserInputError(f"{option} {path} is a folder; expected a text file.")
    elif not path.exists():
        raise UserInputError(f"{option} {path}: no such file.")
    else:
        try:
            with path.open("rb") as f:
                data = f.read(MAX_PROMPT_FILE_BYTES + 1)
        except OSError as err:
            raise UserInputError(f"{option} {path} cannot be read ({err.strerror}).") from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise UserInputError(
            f"{option} {name} holds more than {MAX_PROMPT_FILE_BYTES >> 20} MiB (a device such as /dev/zero never "
            "ends), more than any export's context: give a text file that holds the prompt."
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserInputError(f"{option} {name} is not UTF-8 text ({err.reason} at byte {err.start}).") from None


def read_messages_file(path: Path) -> list:
    """The messages of a --messages file: a JSON list, or an object with a "messages" list (an OpenAI request).

    Each message is checked when the model renders the chat; errors name its index.
    """
    text = read_prompt_file(path, "--messages")
    try:
        value = json.loads(text)
    except RecursionError:
        raise UserInputError(f"--messages {path} nests its JSON too deeply; expected a list of messages.") from None
    except json.JSONDecodeError as err:
        raise UserInputError(
            f"--messages {path} is not JSON ({err.msg} at line {err.lineno}, column {err.colno}); expected a list "
            'of {"role": "...", "content": "..."} messages.'
        ) from None
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list):
        raise UserInputError(
            f'--messages {path} holds a JSON {type(value).__name__}; expected a list of {{"role": "...", '
            '"content": "..."}} messages (or an object with a "messages" list).'
        )
    return value


def config_of(args: argparse.Namespace):
    """The GenerationConfig the flags ask for: only the flags given; every default is GenerationConfig's."""
    from paradecode.runtime.config import GenerationConfig
    from paradecode.runtime.decoding_flags import decoding_fields

    given = {
        "stop": tuple(args.stop) if args.stop else None,
        "ignore_eos": args.ignore_eos or None,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    return GenerationConfig(**decoding_fields(args), **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    def work():  # all of it under run_command, so a Ctrl-C at any moment ends with "interrupted" and 130
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.chat and args.prompt is None and args.prompt_file is None:
            parser.error("--chat renders the text of --prompt or --prompt-file as a user message: give one of them.")
        logging.basicConfig(level=logging.WARNING, format="paradecode-generate: %(message)s", stream=sys.stderr)
        from paradecode.runtime.model import ParaDecodeModel

        config = config_of(args)
        prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt
        messages = read_messages_file(args.messages) if args.messages is not None else None
        if args.chat:
            prompt, messages = None, [{"role": "user", "content": prompt}]
        with ParaDecodeModel(
            args.export,
            backend=args.backend,
            device=args.device,
            lanes=args.lanes,
            threads=args.threads,
            torch_compile=args.compile,
            int4_kernels=args.int4_kernels,
            verify=not args.no_verify,
        ) as model:
            if args.prompt_ids is None and model.tokenizer is None:
                raise UserInputError(f"{args.export} has no tokenizer: use --prompt-ids.")
            stream = model.stream(prompt, prompt_ids=args.prompt_ids, messages=messages, config=config)
            for piece in stream:
                if not args.json:
                    sys.stdout.write(piece.text if model.tokenizer else f"{piece.token} ")
                    sys.stdout.flush()
            return args, stream.result

    code, done = run_command("paradecode-generate", work)
    if code:
        return code
    args, result = done
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
            f"{stats.tokens_per_second:.1f} tokens/s, early exits: {exits}, lookup: {stats.lookup_accepted} of "
            f"{stats.lookup_proposed} accepted"
            + (f", draft head: {stats.draft_accepted} of {stats.draft_proposed}" if stats.draft_proposed else "")
            + f", rollbacks: {stats.rollbacks}, stopped by {stats.stop_reason}"
            + (f", seed {stats.seed}" if stats.seed is not None else "")
            + (
                f", passed up as not paying: {stats.exits_skipped} exit-head calls, {stats.lookups_skipped} lookups"
                if stats.exits_skipped or stats.lookups_skipped
                else ""
            ),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
