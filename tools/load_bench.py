"""`paradecode-loadtest DIR`: a bounded load run against paradecode-serve, ParaDecode vs ar behind the server.

For every mode (--modes), and every --max-batch where several are given, it starts `paradecode-serve DIR --mode
MODE [--max-batch B]` on a free local port (`paradecode.tools.server_process`), waits for /health, runs the load
(`paradecode.tools.load_client`: a warm-up, the RSS, --requests streamed requests per server, --concurrency at
once, in --rounds rounds that alternate the servers, the RSS again) once per --concurrency level (1,2,4,8,16: a
run per level, the lowest first, each on the same servers), and stops the servers (SIGTERM, also on errors and
Ctrl-C). With --url it loads a server that is already running instead, and starts none.

Per mode: p50/p95 time to first token (from sending the request to the first chunk carrying text)
and end-to-end latency, tokens/s (completion tokens, from the server's final `usage` chunk, over the
wall time of the mode's rounds), errors, and the server's RSS before and after. Prints a Markdown
table; --json writes every request's record too. Exit code 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.contrib.logging import logging_redirect_tqdm

from paradecode.export.prompt_sets import NAMES_HELP
from paradecode.graphs.errors import MissingDependencyError, UserInputError, run_command
from paradecode.runtime.config import MODES
from paradecode.tools.load_client import LoadSettings, Record, Target, load
from paradecode.tools.server_process import ServerProcess

PROG = "paradecode-loadtest"
DEFAULT_MODES = "paradecode,ar"
URL_TARGET = "server"  # the one target's name with --url

logger = logging.getLogger("paradecode.loadtest")


def default(name: str) -> str:
    """A LoadSettings field's default, for a help text (the defaults live there only)."""
    return str(LoadSettings.__dataclass_fields__[name].default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("export", metavar="DIR", nargs="?", help="a folder written by paradecode-export")
    parser.add_argument("--requests", type=int, metavar="N", help=f"requests per mode (default {default('requests')})")
    parser.add_argument(
        "--concurrency",
        metavar="C[,C...]",
        help=f"requests in flight; several levels run one after another (default {default('concurrency')})",
    )
    parser.add_argument(
        "--max-batch",
        metavar="B[,B...]",
        help="the servers' --max-batch; several start a server per mode and value (default: the server's)",
    )
    parser.add_argument("--modes", metavar="M1,M2", help=f"from {', '.join(MODES)} (default {DEFAULT_MODES})")
    parser.add_argument(
        "--rounds", type=int, metavar="R", help=f"rounds the modes alternate in (default {default('rounds')})"
    )
    parser.add_argument(
        "--warmup", type=int, metavar="N", help=f"requests per mode before measuring (default {default('warmup')})"
    )
    parser.add_argument("--replicas", type=int, metavar="N", help="the servers' --replicas (default: the server's)")
    parser.add_argument(
        "--max-tokens", type=int, metavar="N", help=f"max_tokens of every request (default {default('max_tokens')})"
    )
    parser.add_argument(
        "--prompts",
        metavar="FILE|NAME",
        help='one prompt per line, or a .jsonl file of {"prompt": ...} (sent to /v1/completions) or {"messages": '
        f"[...]}} lines (sent to /v1/chat/completions), {NAMES_HELP}; default: eval where the export has a chat "
        "template, else built-in code and prose prompts",
    )
    parser.add_argument(
        "--temperature", type=float, metavar="T", help="sample at T, request i seeded with i (default: greedy)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    parser.add_argument("--url", help="load this running server (http://HOST:PORT) instead of starting one per mode")
    parser.add_argument(
        "--start-timeout", type=float, default=300.0, metavar="S", help="seconds for a server to load (default 300)"
    )
    parser.add_argument(
        "--request-timeout", type=float, metavar="S", help=f"seconds per request (default {default('request_timeout')})"
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the summary and every request as JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="OUT.png", help="plot tokens/s and TTFT against the concurrency, per server"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for name in ("httpx", "httpx2"):  # the openai client's transport logs every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    command = shlex.join([PROG, *argv])
    code, outcome = run_command(PROG, lambda: run(args, command), "interrupted; the servers were stopped")
    if code != 0:
        return code
    table, failed, total, unwritten = outcome
    print(table)
    for message in unwritten:
        print(f"{PROG}: error: {message}", file=sys.stderr)
    if failed:
        print(f"{PROG}: {len(failed)} of {total} requests failed; the first: {failed[0].error}", file=sys.stderr)
    return 1 if failed or unwritten else 0


def check_args(args: argparse.Namespace) -> tuple[list[str], LoadSettings]:
    """(the targets: the modes, or [URL_TARGET] with --url; the load settings); bad flags are refused with a
    message naming the flag."""
    given = lambda **fields: {k: v for k, v in fields.items() if v is not None}
    levels = concurrency_levels(args.concurrency)
    settings = LoadSettings(
        **given(
            requests=args.requests,
            concurrency=None if levels is None else levels[-1],
            rounds=args.rounds,
            warmup=args.warmup,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            request_timeout=args.request_timeout,
        ),
        ignore_eos=args.ignore_eos,
    )
    if args.replicas is not None and args.replicas < 1:
        raise UserInputError(f"--replicas must be at least 1, got {args.replicas}.")
    if not args.start_timeout > 0:
        raise UserInputError(f"--start-timeout must be a positive number of seconds, got {args.start_timeout:g}.")
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise UserInputError(f"--url {args.url!r}: expected the server's address, such as http://127.0.0.1:8000.")
        starting = [
            flag
            for flag, value in (("--modes", args.modes), ("--replicas", args.replicas), ("--max-batch", args.max_batch))
            if value is not None
        ]
        if starting:
            raise UserInputError(
                f"{' and '.join(starting)} set how this tool starts its servers; with --url it starts none "
                "(start the server with the settings you want)."
            )
        return [URL_TARGET], settings
    if args.export is None:
        raise UserInputError("give DIR (an export to serve in each mode) or --url (a running server to load).")
    modes = [m.strip() for m in (args.modes or DEFAULT_MODES).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UserInputError(
            f"--modes {args.modes!r}: expected comma-separated modes from {', '.join(MODES)}"
            + (f"; not {', '.join(map(repr, bad))}." if bad else ".")
        )
    if len(set(modes)) < len(modes):
        raise UserInputError(f"--modes {args.modes!r} names a mode more than once.")
    batches = comma_integers(args.max_batch, "--max-batch")
    if batches is None or len(batches) == 1:
        return modes, settings
    return [f"{mode}, batch {b}" for mode in modes for b in batches], settings


def comma_integers(text: str | None, flag: str) -> list[int] | None:
    """`text` ("1,2,4") as distinct integers of at least 1, in its order; None when not given."""
    if text is None:
        return None
    values = []
    for item in text.split(","):
        try:
            value = int(item)
        except ValueError:
            raise UserInputError(f"{flag} {text!r}: expected comma-separated integers, such as 1,2,4.") from None
        if value < 1:
            raise UserInputError(f"{flag} must be an integer of at least 1, got {value}.")
        if value in values:
            raise UserInputError(f"{flag} {text!r} names {value} more than once.")
        values.append(value)
    return values


def concurrency_levels(text: str | None) -> list[int] | None:
    """--concurrency's levels, lowest first; None when not given (LoadSettings' default)."""
    levels = comma_integers(text, "--concurrency")
    return None if levels is None else sorted(levels)


def server_flags(name: str, args: argparse.Namespace) -> list[str]:
    """paradecode-serve's flags for a target named by check_args ("ar", or "ar, batch 8")."""
    mode, _, batch = name.partition(", batch ")
    if not batch and args.max_batch is not None:
        batch = args.max_batch  # one value: every server gets it
    return ["--mode", mode, *(["--max-batch", batch] if batch else [])]


def prompts_of(args: argparse.Namespace) -> list:
    """The prompts (text or a chat's messages): --prompts, else eval where the export has a chat template,
    else the built-in text prompts. Checked against the export where there is one."""
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.runtime.chat import ChatTemplate
    from paradecode.runtime.loader import open_export
    from paradecode.tools.bench_modes import DEFAULT_PROMPTS

    export = open_export(args.export, verify=False) if args.export is not None else None
    if export is not None and export.tokenizer_path is None:
        raise UserInputError(f"{args.export} has no tokenizer: the load test sends text and chat prompts.")
    template = ChatTemplate.from_export(export) if export is not None else None
    if args.prompts:
        prompts = [p.prompt for p in load_prompts(args.prompts)]
    elif template is not None:
        logger.info("prompts: the evaluation set (eval), as the export has a chat template")
        prompts = [p.prompt for p in load_prompts("eval")]
    else:
        logger.info("prompts: the built-in text prompts%s", " (no DIR)" if export is None else "")
        prompts = list(DEFAULT_PROMPTS)
    if not prompts:
        raise UserInputError(f"--prompts {args.prompts}: no prompts in it.")
    chats = sum(not isinstance(p, str) for p in prompts)
    if export is not None and chats and template is None:
        raise UserInputError(
            f"--prompts {args.prompts} holds {chats} chats, but {args.export} has no chat template to render them: "
            "pass text prompts."
        )
    return prompts


def run(args: argparse.Namespace, command: str) -> tuple[str, list[Record], int, list[str]]:
    """(the Markdown table, the failed records, the requests sent, what could not be written: --json, --plot)."""
    from paradecode.tools.reporting import check_outputs, check_plotting, save_figure, save_json, save_outputs

    try:
        import openai  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(f"{PROG} needs the openai client: `pip install openai` ({err}).") from err
    names, settings = check_args(args)
    levels = concurrency_levels(args.concurrency) or [settings.concurrency]
    check_outputs({"--json": args.json, "--plot": args.plot})  # before the run: they are written at its end
    if args.plot is not None:
        check_plotting()
    prompts = prompts_of(args)
    with ExitStack() as stack:
        servers = {}
        if args.url is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="paradecode-loadtest-")))
            # --max-queue: every request in flight may wait, so none is refused for a full queue.
            flags = ["--max-queue", str(settings.concurrency), "--log-level", "warning"]
            if args.replicas is not None:
                flags += ["--replicas", str(args.replicas)]
            servers = {}
            for name in names:
                own = server_flags(name, args)
                logger.info("starting paradecode-serve %s", shlex.join(own))
                server = ServerProcess(
                    Path(args.export), [*own, *flags], log_dir, name=name, start_timeout=args.start_timeout
                )
                servers[name] = stack.enter_context(server)
        records, levels_summary = [], {}
        for level in levels:
            level_settings = replace(settings, concurrency=level, warmup=settings.warmup if not records else 0)
            logger.info(
                "%d requests per server (%s), %d at once, in %d rounds; max_tokens %d",
                settings.requests,
                ", ".join(names),
                level,
                settings.rounds,
                settings.max_tokens,
            )
            if args.url is None:
                targets = [Target(name, server.url) for name, server in servers.items()]
            else:
                targets = [Target(URL_TARGET, args.url.rstrip("/").removesuffix("/v1"))]
            with logging_redirect_tqdm():
                level_records = asyncio.run(load(targets, prompts, level_settings))
            records += level_records
            levels_summary[level] = {
                t.name: summarize([r for r in level_records if r.target == t.name], t) for t in targets
            }
    summary = levels_summary[levels[-1]]
    ratio = speedup(summary)
    agreement = answers_agree(records, len(prompts)) if settings.temperature is None else None
    table = markdown(levels_summary, settings)
    if agreement is not None:
        differing, total = agreement["differing"], agreement["prompts"]
        table += (
            f"\n\nanswers: {differing} of {total} prompts got more than one answer over every server, mode and "
            "level (greedy: each prompt should get one)"
        )
    outputs = []
    if args.json:
        from paradecode.tools.bench_modes import machine

        report = {
            "command": command,
            "export": str(Path(args.export).resolve()) if args.export else None,
            "url": args.url,
            "machine": machine(),
            "settings": asdict(settings),
            "flags": {k: None if v is None else str(v) for k, v in vars(args).items()},
            "servers": {name: {"url": s.url, "command": shlex.join(s.command)} for name, s in servers.items()},
            "prompts": prompts,
            "summary": summary,  # at the highest concurrency
            "levels": {str(level): rows for level, rows in levels_summary.items()},
            "paradecode_vs_ar": ratio,
            "answers": agreement,
            "records": [asdict(r) for r in records],
        }
        outputs.append(("--json", args.json, lambda path: save_json(path, report)))
    if args.plot is not None:
        outputs.append(("--plot", args.plot, lambda path: save_figure(path, load_figure(levels_summary, settings))))
    unwritten = save_outputs(outputs)
    return table, [r for r in records if r.error is not None], len(records), unwritten


def answers_agree(records: list[Record], prompts: int) -> dict[str, Any]:
    """Greedy answers, compared: per prompt, the distinct texts its successful requests got over every server, mode
    and concurrency level (a batch, ParaDecode and plain decoding must all give a prompt plain decoding's answer)."""
    texts: dict[int, set[str]] = {}
    for record in records:
        if record.error is None and record.finish_reason is not None:
            texts.setdefault(record.index % prompts, set()).add(record.text)
    differing = sorted(prompt for prompt, seen in texts.items() if len(seen) > 1)
    return {"prompts": len(texts), "differing": len(differing), "differing_prompts": differing}


def summarize(records: list[Record], target: Target) -> dict[str, Any]:
    """One target's figures: counts, p50/p95 TTFT and latency (ms), tokens/s over its rounds, RSS (MB)."""
    ok = [r for r in records if r.error is None]
    first = [r.first_token_seconds for r in ok if r.first_token_seconds is not None]
    tokens = sum(r.completion_tokens for r in ok)
    mb = lambda value: None if value is None else value / 2**20
    row = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "without_text": len(ok) - len(first),
        "completion_tokens": tokens,
        "tokens_from": sorted({r.tokens_from for r in ok}),
        "wall_seconds": target.wall_seconds,
        "tokens_per_second": tokens / target.wall_seconds if target.wall_seconds > 0 else None,
        "rss_mb_before": mb(target.rss_before),
        "rss_mb_peak": mb(target.rss_peak),
        "rss_mb_after": mb(target.rss_after),
        "rss_mb_growth": None
        if None in (target.rss_before, target.rss_after)
        else mb(target.rss_after - target.rss_before),
    }
    # a request's inter-token latency: its mean time between two tokens after the first (streamed)
    itl = [
        (r.latency_seconds - r.first_token_seconds) / (r.completion_tokens - 1)
        for r in ok
        if r.first_token_seconds is not None and r.completion_tokens > 1
    ]
    for name, values in (("ttft", first), ("itl", itl), ("latency", [r.latency_seconds for r in ok])):
        p50, p95 = percentiles_ms(values)
        row[f"{name}_ms_p50"], row[f"{name}_ms_p95"] = p50, p95
    return row


def load_figure(levels: dict[int, dict[str, dict[str, Any]]], settings: LoadSettings):
    """Left: aggregate tokens/s against concurrent clients, per server; right: TTFT and ITL p50 (p95 dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    clients = sorted(levels)
    names = list(dict.fromkeys(name for level in clients for name in levels[level]))
    for name in names:
        rows = [(c, levels[c][name]) for c in clients if name in levels[c]]
        xs = [c for c, _ in rows]
        left.plot(xs, [r["tokens_per_second"] for _, r in rows], marker="o", label=name)
        (line,) = right.plot(xs, [r["ttft_ms_p50"] for _, r in rows], marker="o", label=f"{name}: TTFT")
        right.plot(xs, [r["ttft_ms_p95"] for _, r in rows], ls=":", color=line.get_color())
        right.plot(
            xs, [r["itl_ms_p50"] for _, r in rows], marker="s", ls="--", color=line.get_color(), label=f"{name}: ITL"
        )
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(clients, [str(c) for c in clients])
        axis.set_xlabel("concurrent streaming clients")
        axis.legend(fontsize=8)
    left.set_ylabel("aggregate completion tokens/s")
    left.set_title(f"throughput ({settings.max_tokens} tokens per request)")
    times = [row[key] for level in levels.values() for row in level.values() for key in ("ttft_ms_p50", "itl_ms_p50")]
    if any(t is not None and t > 0 for t in times):  # no request brought text: nothing to scale (matplotlib refuses)
        right.set_yscale("log")
    right.set_ylabel("ms (p50; TTFT p95 dotted)")
    right.set_title("time to first token and between tokens")
    return figure


def percentiles_ms(values: list[float]) -> tuple[float | None, float | None]:
    """p50 and p95 in ms, nearest-rank (always a measured value); None without values."""
    if not values:
        return None, None
    p50, p95 = np.percentile(values, [50, 95], method="nearest")
    return 1e3 * float(p50), 1e3 * float(p95)


def speedup(summary: dict[str, dict[str, Any]]) -> float | None:
    """ParaDecode's tokens/s over ar's, where both were measured."""
    rates = [summary.get(mode, {}).get("tokens_per_second") for mode in ("paradecode", "ar")]
    return rates[0] / rates[1] if None not in rates and rates[1] > 0 else None


def markdown(levels: dict[int, dict[str, dict[str, Any]]], settings: LoadSettings) -> str:
    """One row per concurrency level and server; `x 1 client`: its tokens/s over the same server's with one client
    (where that level ran)."""
    fmt = lambda value, digits=1: "-" if value is None else f"{value:.{digits}f}"
    lines = [
        f"{settings.requests} requests per server and level, in {settings.rounds} rounds alternating the servers; "
        f"max_tokens {settings.max_tokens}; TTFT, ITL (a request's mean time between tokens) and latency in ms; "
        "tok/s = completion tokens / the server's wall time at that level",
        "",
        "| clients | server | requests | errors | TTFT p50 | TTFT p95 | ITL p50 | ITL p95 | latency p50 | "
        "latency p95 | tokens | tok/s | x 1 client | RSS before MB | RSS peak MB | RSS after idle MB | RSS growth MB |",
        "| ---: | --- " + "| ---: " * 15 + "|",
    ]
    for level, summary in levels.items():
        for name, row in summary.items():
            alone = levels.get(1, {}).get(name, {}).get("tokens_per_second")
            rate = row["tokens_per_second"]
            gain = rate / alone if alone and rate is not None else None
            lines.append(
                f"| {level} | {name} | {row['requests']} | {row['errors']} | {fmt(row['ttft_ms_p50'])} | "
                f"{fmt(row['ttft_ms_p95'])} | {fmt(row['itl_ms_p50'])} | {fmt(row['itl_ms_p95'])} | "
                f"{fmt(row['latency_ms_p50'])} | {fmt(row['latency_ms_p95'])} | "
                f"{row['completion_tokens']} | {fmt(rate)} | {fmt(gain, 2)} | {fmt(row['rss_mb_before'])} | "
                f"{fmt(row['rss_mb_peak'])} | {fmt(row['rss_mb_after'])} | {fmt(row['rss_mb_growth'])} |"
            )
        ratio = speedup(summary)
        if ratio is not None:
            lines += ["", f"{level} client(s): paradecode tokens/s over ar: {ratio:.2f}x", ""]
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    sys.exit(main())
