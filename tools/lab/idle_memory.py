"""A server's resident memory across rounds of long prompts decoded together: fresh, warm, each round's peak and the
idle value after it (issue 52: idle memory that never came back).

usage: python tools/lab/idle_memory.py EXPORT ROUNDS OUT.json [paradecode-serve flags...]

Starts `paradecode-serve EXPORT --max-batch 8 FLAGS` on 127.0.0.1 (tools/server_process.py), sends one short request,
then per round 4 prompts of about 775 tokens at once (64 greedy tokens each), and reads the server's VmRSS every
0.2 s while they decode and 3 s after the last ends. Writes OUT.json after each round.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx

from tools.server_process import ServerProcess

TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing past old stone bridges ."


def long_prompt(i: int) -> str:
    words = TEXT.split()
    body = " ".join(words[(j * 7 + i) % len(words)] for j in range(760))
    return f"Document {i}: {body}\nSummarize the document above in one sentence."


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def main() -> None:
    export, rounds, out, flags = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    results: dict = {"export": str(export), "flags": flags, "rounds": []}
    with ServerProcess(export, ["--max-batch", "8", *flags], out.parent, name="idle-memory-server") as server:
        pid, model = server.process.pid, export.name

        def complete(prompt: str, max_tokens: int) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            return response.json()["usage"]

        results["fresh_mb"] = resident_mb(pid)
        complete("hi", 8)
        time.sleep(2)
        results["warm_mb"] = resident_mb(pid)
        print(f"fresh {results['fresh_mb']:.0f} MB, warm {results['warm_mb']:.0f} MB", flush=True)
        for r in range(rounds):
            usage: list[dict] = [{}] * 4

            def ask(k: int, r: int, usage: list[dict]) -> None:
                usage[k] = complete(long_prompt(4 * r + k), 64)

            threads = [threading.Thread(target=ask, args=(k, r, usage)) for k in range(4)]
            for thread in threads:
                thread.start()
            peak = 0.0
            while any(t.is_alive() for t in threads):
                peak = max(peak, resident_mb(pid))
                time.sleep(0.2)
            time.sleep(3)
            idle = resident_mb(pid)
            tokens = [u["prompt_tokens"] for u in usage]
            results["rounds"].append({"peak_mb": peak, "idle_mb": idle, "prompt_tokens": tokens})
            print(f"round {r + 1}: peak {peak:.0f} MB, idle {idle:.0f} MB", flush=True)
            out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
