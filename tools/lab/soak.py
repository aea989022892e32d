"""A soak of `paradecode-serve` with faults (issue 52, item 8): two servers of one export, ParaDecode and plain
decoding, under clients that mix greedy and seeded requests, short and long prompts, completions and chat, and
streams they drop; the ParaDecode server is stopped by SIGTERM under load and restarted on its port, and its export
folder is changed under load and put back.

usage: python tools/lab/soak.py EXPORT OUT_DIR [--minutes 30] [--clients 8] [paradecode-serve flags...]

Loopback only (both servers on 127.0.0.1), bounded by --minutes (the clients start nothing after it; what is in
flight then finishes). Writes OUT_DIR/soak.json every minute and at the end, and every request's outcome to
OUT_DIR/soak-requests.jsonl. What it checks:
- lost: requests a server accepted (200 and a stream) that ended without a finish reason, other than those a client
  dropped on purpose (0 expected: a SIGTERM lets accepted streams finish, and nothing here sends SIGKILL);
- identical: every repeated greedy request (same endpoint, prompt and max_tokens) got one text on both servers, and
  every repeated seeded one (same seed too) one text from each server;
- memory: each server's VmRSS every 2 s; its least, median and most in each quarter of the soak, and their growth
  from the second quarter to the last (the SIGTERM and restart come in the first, so both are one process's): the
  least (what the server comes back to) and the most (its peaks) may grow 5% at most; the median is reported, not
  judged, as it follows how many long prompts each quarter happened to draw;
- faults: SIGTERM (exit code, streams in flight at the signal and how they ended, seconds to serve again on the
  same port); export change (seconds until /health says `export_changed`, requests refused meanwhile, seconds to
  answer again once the file is back).
Refused requests (429 past the queue, 503 while stopping or while the export is changed, connection refused while
restarting) are counted by reason, never as lost.

Threading model: one asyncio loop runs the clients, the memory sampler and the faults, and owns `Soak`'s state;
starting and stopping a server (blocking waits on a subprocess) run in worker threads through asyncio.to_thread,
and only the loop reads or writes what they return.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from paradecode.tools.server_process import ServerFailed, ServerProcess

TARGETS = ("paradecode", "ar")  # each target is a server started with --mode TARGET
SHORT = (
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the capital of France? Answer in one sentence.",
    "Give three tips for staying focused while studying.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Explain in two sentences why the sky is blue.",
    "List the first ten prime numbers.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Write a haiku about autumn leaves.",
)
PASSAGE = (
    "Water on Earth is always moving. The sun heats oceans, lakes and rivers, and some of their water turns into "
    "vapour that rises into the air, cools, and condenses into droplets that form clouds. When the droplets grow "
    "too heavy they fall as rain or snow, soak into the soil or run back to the sea, and the cycle continues. "
)
LONG_REPEATS = 13  # PASSAGE x 13 and a question: about 930 SmolLM2 tokens
LONG = tuple(
    f"Document {i}.\n{PASSAGE * LONG_REPEATS}\nQuestion {i}: {q}"
    for i, q in enumerate(("Where does rain come from?", "What heats the water?", "Where does the water go?"))
)
PROMPTS = SHORT + LONG
MAX_TOKENS = {False: 48, True: 32}  # per prompt kind (long: True)
SEEDS = (1, 2, 3)  # few, so that seeded requests repeat
TEMPERATURE = 0.8
RSS_EVERY = 2.0  # seconds
REPORT_EVERY = 60.0  # seconds
RSS_GROWTH = 0.05  # the most a server's memory may grow from the soak's second quarter to its last
JUDGED = ("min", "max")  # each quarter's floor and peak; its median is reported, not judged: it follows the mix
REFUSED_PAUSE = 0.5  # seconds a client waits after a refusal (at most Retry-After) before its next request


@dataclass(frozen=True)
class Job:
    """One request a client sends: to which server, what, and whether it drops the stream on purpose."""

    target: str
    endpoint: str  # "completions" or "chat"
    prompt: int  # index into PROMPTS
    seed: int | None  # None: greedy
    drop_after: int | None  # the client closes the stream after this many chunks (0: before any); None: reads it all

    @property
    def long(self) -> bool:
        return self.prompt >= len(SHORT)

    def body(self, model: str) -> dict:
        body: dict = {"model": model, "max_tokens": MAX_TOKENS[self.long], "stream": True, "temperature": 0.0}
        if self.seed is not None:
            body.update(temperature=TEMPERATURE, seed=self.seed)
        if self.endpoint == "completions":
            body["prompt"] = PROMPTS[self.prompt]
        else:
            body["messages"] = [{"role": "user", "content": PROMPTS[self.prompt]}]
        return body

    def answer_key(self) -> str:
        """Requests that must get one text: greedy ones across both servers, seeded ones per server."""
        sampled = "greedy" if self.seed is None else f"seed {self.seed} on {self.target}"
        return f"{self.endpoint} prompt {self.prompt} max_tokens {MAX_TOKENS[self.long]} {sampled}"


def job_of(rng: random.Random) -> Job:
    """A job drawn as the mix asks: both servers alike, every 10th prompt long, 40% seeded, 10% dropped."""
    long = rng.random() < 0.1
    prompt = len(SHORT) + rng.randrange(len(LONG)) if long else rng.randrange(len(SHORT))
    return Job(
        target=rng.choice(TARGETS),
        endpoint="completions" if long else rng.choice(("completions", "chat")),
        prompt=prompt,
        seed=rng.choice(SEEDS) if rng.random() < 0.4 else None,
        drop_after=rng.choice((0, 1, 4)) if rng.random() < 0.1 else None,
    )


@dataclass
class Outcome:
    """What one request got. `status`: completed, dropped (by the client, on purpose), refused (never accepted),
    lost (accepted, then ended without a finish reason)."""

    job: Job
    started: float  # seconds since the soak began
    status: str = ""
    reason: str = ""  # refused: "429", "503 shutting_down", "unreachable", ...; lost: the error
    text: str = ""
    finish_reason: str | None = None
    seconds: float = 0.0


async def send(http: httpx.AsyncClient, url: str, model: str, job: Job, outcome: Outcome, streaming: set) -> float:
    """Send `job`, fill in `outcome`; returns the seconds to wait before the next request (after a refusal)."""
    path = "/v1/completions" if job.endpoint == "completions" else "/v1/chat/completions"
    accepted = False
    try:
        async with http.stream("POST", url + path, json=job.body(model)) as response:
            if response.status_code != 200:
                await response.aread()
                try:
                    error = response.json()["error"]
                    code = error.get("code") or error.get("type") or ""
                except (ValueError, KeyError, TypeError, AttributeError):
                    code = "(no JSON error)"
                outcome.status, outcome.reason = "refused", f"{response.status_code} {code}".strip()
                return min(float(response.headers.get("retry-after", REFUSED_PAUSE)), 2.0)
            accepted = True
            streaming.add(id(outcome))
            chunks = 0
            if job.drop_after == 0:
                outcome.status = "dropped"
                return 0.0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    outcome.status, outcome.reason = "lost", f"error event: {chunk['error']}"
                    return 0.0
                for choice in chunk["choices"]:
                    piece = choice["text"] if job.endpoint == "completions" else choice["delta"].get("content")
                    outcome.text += piece or ""
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                chunks += 1
                if job.drop_after is not None and chunks >= job.drop_after:
                    outcome.status = "dropped"
                    return 0.0
            if outcome.finish_reason is None:
                outcome.status, outcome.reason = "lost", "the stream ended without a finish_reason"
            else:
                outcome.status = "completed"
            return 0.0
    except httpx.HTTPError as err:
        if accepted:
            outcome.status, outcome.reason = "lost", f"{type(err).__name__}: {err}"
        else:
            outcome.status, outcome.reason = "refused", "unreachable"
        return REFUSED_PAUSE
    finally:
        streaming.discard(id(outcome))


@dataclass
class Soak:
    """The soak's servers, what every request got, and what the faults and the memory sampler saw."""

    exports: dict[str, Path]
    flags: list[str]
    out: Path
    seconds: float
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    streaming: dict[str, set] = field(default_factory=lambda: {t: set() for t in TARGETS})  # ids of open streams
    rss: list[tuple[float, str, int, float]] = field(default_factory=list)  # (seconds, target, pid, MB)
    faults: list[dict] = field(default_factory=list)
    clock: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.clock

    def start(self, target: str, port: int | None = None, run: int = 1) -> ServerProcess:
        flags = ["--mode", target, "--served-model-name", "soak", *self.flags]
        server = ServerProcess(self.exports[target], flags, self.out, name=f"soak-{target}-{run}", port=port)
        return server.__enter__()

    async def client(self, number: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(number)
        while self.now() < self.seconds:
            job = job_of(rng)
            outcome = Outcome(job, started=self.now())
            self.outcomes.append(outcome)
            server = self.servers[job.target]
            start = time.monotonic()
            pause = await send(http, server.url, "soak", job, outcome, self.streaming[job.target])
            outcome.seconds = time.monotonic() - start
            await asyncio.sleep(pause)

    async def sample_memory(self) -> None:
        while True:
            for target, server in self.servers.items():
                with contextlib.suppress(ServerFailed):  # it fails between a SIGTERM and its restart
                    self.rss.append((self.now(), target, server.process.pid, server.resident_bytes() / 2**20))
            await asyncio.sleep(RSS_EVERY)

    async def sigterm_and_restart(self, target: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - self.now()))
        server = self.servers[target]
        in_flight = [o for o in self.outcomes if id(o) in self.streaming[target]]
        fault: dict = {"fault": "SIGTERM and restart", "target": target, "at_seconds": self.now()}
        fault["streams_in_flight"] = len(in_flight)
        await asyncio.to_thread(server.stop)  # SIGTERM, then waits for the in-flight requests to finish
        fault["exit_code"] = server.process.returncode
        fault["stopped_after_seconds"] = self.now() - fault["at_seconds"]
        self.servers[target] = await asyncio.to_thread(self.start, target, server.port, 2)
        fault["serving_again_after_seconds"] = self.now() - fault["at_seconds"]
        fault["in_flight_ended"] = dict(Counter(o.status for o in in_flight))
        self.faults.append(fault)

    async def change_export(self, target: str, at: float, hold: float, http: httpx.AsyncClient) -> None:
        """Flip one byte of the export's smallest graph file (atomically, as a re-export would), keep the load on
        for `hold` seconds, put the file back."""
        await asyncio.sleep(max(0.0, at - self.now()))
        victim = min(self.exports[target].rglob("*.onnx"), key=lambda p: p.stat().st_size)
        original = victim.read_bytes()
        fault: dict = {"fault": "export changed and put back", "target": target, "file": victim.name}
        fault["at_seconds"] = begin = self.now()
        replace(victim, original[:-1] + bytes([original[-1] ^ 1]))
        fault["health_503_after_seconds"] = await self.health_becomes(http, target, 503)
        await asyncio.sleep(hold)
        replace(victim, original)
        fault["put_back_at_seconds"] = back = self.now()
        fault["health_200_after_seconds"] = await self.health_becomes(http, target, 200)
        refused = [o for o in self.outcomes if o.job.target == target and begin <= o.started < back]
        fault["requests_meanwhile"] = dict(Counter(f"{o.status} {o.reason}".strip() for o in refused))
        self.faults.append(fault)

    async def health_becomes(self, http: httpx.AsyncClient, target: str, status: int) -> float | None:
        begin = self.now()
        while self.now() - begin < 60:
            try:
                if (await http.get(self.servers[target].url + "/health")).status_code == status:
                    return self.now() - begin
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        return None  # not within 60 s: the summary shows it

    def summary(self) -> dict:
        by_status = Counter(o.status or "in flight" for o in self.outcomes)
        refused = Counter(o.reason for o in self.outcomes if o.status == "refused")
        lost = [asdict(o) for o in self.outcomes if o.status == "lost"]
        texts: dict[str, Counter] = defaultdict(Counter)
        for o in self.outcomes:
            if o.status == "completed":
                texts[o.job.answer_key()][o.text] += 1
        repeated = {key: c for key, c in texts.items() if sum(c.values()) > 1}
        differing = {key: [{"count": n, "text": t} for t, n in c.items()] for key, c in repeated.items() if len(c) > 1}
        memory = {}
        quarter = self.seconds / 4
        for target in TARGETS:
            samples = [(int(t // quarter), mb) for t, name, _, mb in self.rss if name == target]
            quarters = [[mb for q_of, mb in samples if q_of == q] for q in range(4)]
            figures = {
                "min": [min(q) if q else None for q in quarters],
                "median": [statistics.median(q) if q else None for q in quarters],
                "max": [max(q) if q else None for q in quarters],
            }
            memory[target] = {f"{name}_mb_by_quarter": values for name, values in figures.items()}
            memory[target]["growth_q2_to_q4"] = {
                name: values[3] / values[1] - 1 if values[1] and values[3] else None for name, values in figures.items()
            }
        return {
            "seconds": self.seconds,
            "elapsed_seconds": self.now(),
            "flags": self.flags,
            "requests": len(self.outcomes),
            "by_status": dict(by_status),
            "refused_by_reason": dict(refused),
            "lost": lost,
            "completed_text_chars": sum(len(o.text) for o in self.outcomes if o.status == "completed"),
            "repeated_answer_keys": len(repeated),
            "repeated_requests": sum(sum(c.values()) for c in repeated.values()),
            "differing_answer_keys": differing,
            "memory": memory,
            "faults": self.faults,
            "rss_samples": [[round(t, 1), name, pid, round(mb, 1)] for t, name, pid, mb in self.rss],
        }

    def write(self) -> dict:
        summary = self.summary()
        replace(self.out / "soak.json", json.dumps(summary, indent=1).encode())
        with (self.out / "soak-requests.jsonl").open("w") as f:
            for o in self.outcomes:
                f.write(json.dumps(asdict(o)) + "\n")
        return summary

    async def report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY)
            s = self.write()
            rss = {t: round(mb) for _, t, _, mb in self.rss[-len(TARGETS) :]}
            print(
                f"{self.now() / 60:5.1f} min: {s['requests']} requests {s['by_status']}, "
                f"{len(s['differing_answer_keys'])} differing of {s['repeated_answer_keys']} repeated, RSS MB {rss}",
                flush=True,
            )


def replace(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a temporary file beside it, then a rename)."""
    temporary = path.with_name(path.name + ".soak-tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


async def soak(soak: Soak, clients: int) -> dict:
    for target in TARGETS:
        soak.servers[target] = await asyncio.to_thread(soak.start, target)
    soak.clock = time.monotonic()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as http:
        background = [asyncio.create_task(soak.sample_memory()), asyncio.create_task(soak.report())]
        faults = [
            asyncio.create_task(soak.sigterm_and_restart("paradecode", at=0.15 * soak.seconds)),
            asyncio.create_task(soak.change_export("paradecode", at=0.5 * soak.seconds, hold=60.0, http=http)),
        ]
        await asyncio.gather(*(soak.client(n, http) for n in range(clients)), *faults)
        for task in background:
            task.cancel()
    return soak.write()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("out", type=Path, help="a folder for the results, the servers' logs and the export's copy")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    args, flags = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = args.out / "export-copy"  # the ParaDecode server's, which the soak changes and puts back
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(args.export, copy)
    state = Soak(exports={"paradecode": copy, "ar": args.export}, flags=flags, out=args.out, seconds=args.minutes * 60)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped soak still stops its servers
    try:
        summary = asyncio.run(soak(state, args.clients))
    finally:
        for server in state.servers.values():
            server.stop()
    memory = {t: {k: m["growth_q2_to_q4"][k] for k in JUDGED} for t, m in summary["memory"].items()}
    print(json.dumps({k: summary[k] for k in ("requests", "by_status", "refused_by_reason")}))
    lost, differing = len(summary["lost"]), len(summary["differing_answer_keys"])
    print(f"lost {lost}, differing answers {differing}, RSS growth from the second to the last quarter {memory}")
    ok = not summary["lost"] and not summary["differing_answer_keys"]
    ok = ok and all(g is not None and g <= RSS_GROWTH for growth in memory.values() for g in growth.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
