"""A server's resident memory across rounds of long prompts decoded together: fresh, warm, each round's peak and the
idle value after it (issue 52: idle memory that never came back).

usage: python tools/lab/idle_memory.py EXPORT ROUNDS OUT.json [--words N] [paradecode-serve flags...]

Starts `paradecode-serve EXPORT --max-batch 8 FLAGS` on 127.0.0.1 (tools/server_process.py), sends one short request,
then per round 4 prompts of N words at once (64 greedy tokens each; 760 words, the default, are about 775 SmolLM2
tokens, 915 about 930), and reads the server's VmRSS every 0.2 s while they decode and 3 s after the last ends.
Writes OUT.json after each round.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

from paradecode.tools.server_process import ServerProcess

TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing past old stone bridges ."


def long_prompt(i: int, length: int) -> str:
    words = TEXT.split()
    body = " ".join(words[(j * 7 + i) % len(words)] for j in range(length))
    return f"Document {i}: {body}\nSummarize the document above in one sentence."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("rounds", type=int)
    parser.add_argument("out", type=Path, help="the results' JSON file")
    parser.add_argument("--words", type=int, default=760, help="words in each long prompt (default 760)")
    args, flags = parser.parse_known_args()
    export, out = args.export, args.out
    results: dict = {"export": str(export), "flags": flags, "words": args.words, "rounds": []}
    with ServerProcess(export, ["--max-batch", "8", *flags], out.parent, name="idle-memory-server") as server:
        model = export.name

        def resident_mb() -> float:
            return server.resident_bytes() / 2**20

        def complete(prompt: str, max_tokens: int) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            return response.json()["usage"]

        results["fresh_mb"] = resident_mb()
        complete("hi", 8)
        time.sleep(2)
        results["warm_mb"] = resident_mb()
        print(f"fresh {results['fresh_mb']:.0f} MB, warm {results['warm_mb']:.0f} MB", flush=True)
        for r in range(args.rounds):
            usage: list[dict] = [{}] * 4

            def ask(k: int, r: int, usage: list[dict]) -> None:
                usage[k] = complete(long_prompt(4 * r + k, args.words), 64)

            threads = [threading.Thread(target=ask, args=(k, r, usage)) for k in range(4)]
            for thread in threads:
                thread.start()
            peak = 0.0
            while any(t.is_alive() for t in threads):
                peak = max(peak, resident_mb())
                time.sleep(0.2)
            time.sleep(3)
            idle = resident_mb()
            tokens = [u["prompt_tokens"] for u in usage]
            results["rounds"].append({"peak_mb": peak, "idle_mb": idle, "prompt_tokens": tokens})
            print(f"round {r + 1}: peak {peak:.0f} MB, idle {idle:.0f} MB", flush=True)
            out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
