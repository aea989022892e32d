"""Resident memory of one paradecode-serve over rounds of streamed requests: does it grow round after round?

Starts `paradecode-serve EXPORT` on a free local port (`paradecode.tools.server_process`: waits for /health, SIGTERM
at the end), sends a warm-up, then ROUNDS rounds of REQUESTS greedy streamed completions, CONCURRENCY in flight,
max_tokens MAX_TOKENS, request i with the built-in prompt i (cycled; `paradecode.tools.load_client`). The server's
RSS and peak RSS (VmRSS, VmHWM of /proc/PID/status) are read after the warm-up and after every round, when no request
is in flight. Prints a Markdown table and writes OUT.json and OUT.md.

    python tools/results/cpu-2core/serve-memory.py EXPORT OUT [--rounds 10] [--requests 500] [--concurrency 8]
        [--max-tokens 32] [--serve-flag=--max-batch=8 ...]
"""

import argparse
import asyncio
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from paradecode.tools.bench_modes import DEFAULT_PROMPTS, machine
from paradecode.tools.load_client import LoadSettings, Target, load
from paradecode.tools.server_process import ServerProcess


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (the peak) of process `pid`, in MB (2^20 bytes)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[key].split()[0]) / 1024 for name, key in (("rss_mb", "VmRSS"), ("peak_mb", "VmHWM"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("out", type=Path, help="OUT.json and OUT.md are written (OUT without a suffix)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=500, help="per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serve-flag", action="append", default=[], help="passed to paradecode-serve, e.g. =--lanes=1")
    args = parser.parse_args()
    command = shlex.join(["python", *sys.argv])
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-memory-") as logs:
        flags = ["--max-queue", str(args.concurrency), "--log-level", "warning", *args.serve_flag]
        with ServerProcess(args.export, flags, Path(logs), start_timeout=600) as server:
            target = Target("server", server.url)
            for round_ in range(args.rounds + 1):  # round 0: the warm-up
                settings = LoadSettings(
                    requests=args.requests if round_ else 2 * args.concurrency,
                    concurrency=args.concurrency,
                    rounds=1,
                    warmup=0,
                    max_tokens=args.max_tokens,
                )
                clock = time.perf_counter()
                records = asyncio.run(load([target], DEFAULT_PROMPTS, settings))
                row = {
                    "round": round_,
                    "requests": len(records),
                    "errors": sum(r.error is not None for r in records),
                    "completion_tokens": sum(r.completion_tokens for r in records),
                    "seconds": round(time.perf_counter() - clock, 1),
                    **memory_mb(server.process.pid),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            serve_command = shlex.join(server.command)
    first, last = rows[1]["rss_mb"], rows[-1]["rss_mb"]
    manifest = json.loads((args.export / "manifest.json").read_text())
    quantization = manifest.get("quantization")
    kind = "float weights" if not quantization else f"quantized weights, {quantization['activations']} activations"
    model = f"{manifest['model']['source']} ({manifest['spec']['family']}, {kind})"
    host = machine()
    report = {
        "command": command,
        "serve_command": serve_command,
        "export": str(args.export.resolve()),
        "model": model,
        "date_utc": started.isoformat(timespec="seconds"),
        "machine": host,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
        "rss_growth_mb_round_1_to_last": last - first,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"`{command}` ({started:%Y-%m-%d %H:%M} UTC)",
        "",
        f"server: `{serve_command}`",
        "",
        f"export: {args.export.resolve()}, {model}",
        "",
        f"machine: {host['cpus']} CPUs, {host['platform']}, Python {host['python']}, torch {host['torch']}, "
        f"onnxruntime {host['onnxruntime']}",
        "",
        f"{args.requests} greedy streamed completions per round, {args.concurrency} in flight, max_tokens "
        f"{args.max_tokens}, the built-in text prompts cycled; round 0 is the warm-up ({2 * args.concurrency} "
        "requests). RSS and peak RSS (VmRSS, VmHWM) of the server process after each round, in MB (2^20 bytes).",
        "",
        "| round | requests | errors | completion tokens | seconds | RSS MB | peak RSS MB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['round']} | {r['requests']} | {r['errors']} | {r['completion_tokens']} | {r['seconds']} | "
            f"{r['rss_mb']:.1f} | {r['peak_mb']:.1f} |"
            for r in rows
        ),
        "",
        f"RSS after round 1: {first:.1f} MB; after round {args.rounds}: {last:.1f} MB ({last - first:+.1f} MB).",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
