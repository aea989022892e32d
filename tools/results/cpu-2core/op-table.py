"""One decoding step, operator by operator: our export's calls against onnxruntime-genai's graph, both profiled by
onnxruntime (tools/results/cpu-2core/op-table.md).

    python tools/results/cpu-2core/op-table.py EXPORT GENAI_FOLDER OUT.json [TOKENS] [THREADS]

EXPORT: a paradecode export (plain decoding, `ar`, as the runtime runs it: its own sessions, threads and calls).
GENAI_FOLDER: onnxruntime-genai's model builder output for the same weights (`model.onnx`, `genai_config.json`),
run by plain onnxruntime with the session options its config gives (THREADS overrides its intra-op threads, 2 by
default as measured best here), fed the way onnxruntime-genai feeds it on a CPU (past key/values in, present out).
Both decode the same chat prompt greedily for TOKENS steps (64) after its prefill; the first 4 steps are dropped.

Per side: microseconds per token by operator kind (onnxruntime's Node events), per call (Session `model_run`), and
host time (a step's wall time less its calls' `model_run` time: Python, bindings, copies between calls). For the
peer, onnxruntime-genai's own loop is timed as well (`og.Generator`, the same prompt and tokens): its wall time per
token less the profiled run time is its host time. The profiler slows every operator a little; the run is also timed
unprofiled (tokens/s), which is what the table's last rows compare.
"""

import collections
import glob
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from paradecode.runtime import load
from paradecode.runtime.decoding import MAIN, DecodeContext, prefill
from paradecode.runtime.tracing import Timeline

DROPPED = 4
MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
KINDS = {  # operator -> the kind the table groups it under
    "MatMulNBits": "quantized matmul",
    "MatMulIntegerToFloat": "quantized matmul",
    "DynamicQuantizeMatMul": "quantized matmul",
    "MatMul": "float matmul",
    "Gemm": "float matmul",
    "GroupQueryAttention": "attention",
    "MultiHeadAttention": "attention",
    "Attention": "attention",
    "SimplifiedLayerNormalization": "norm",
    "SkipSimplifiedLayerNormalization": "norm",
    "RMSNormalization": "norm",
    "LayerNormalization": "norm",
    "SkipLayerNormalization": "norm",
    "RotaryEmbedding": "rotary",
    "Add": "elementwise",
    "Mul": "elementwise",
    "Sub": "elementwise",
    "Div": "elementwise",
    "Sigmoid": "elementwise",
    "QuickGelu": "elementwise",
    "Softmax": "head top-1",
    "ArgMax": "head top-1",
    "TopK": "head top-1",
    "ReduceMax": "head top-1",
    "Gather": "embedding",
    "GatherBlockQuantized": "embedding",
    "ReduceSum": "block sums",
}


def kind_of(op: str, node: str = "") -> str:
    """A node's kind: by its operator, except that every node of our attention (export/attention.py names them under
    `/attention/`: its products, mask, softmax, cache writes) is "attention"."""
    if "/attention/" in node:
        return "attention"
    return KINDS.get(op, "casts, copies, shapes")


def read_profiles(pattern: str) -> list[list[dict]]:
    return [json.loads(Path(name).read_text()) for name in sorted(glob.glob(pattern))]


def runs_of(events: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each `model_run` of a session's profile with the node events inside it, in order."""
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    nodes = sorted(
        (e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")), key=lambda e: e["ts"]
    )
    out, i = [], 0
    for run in runs:
        inside = []
        while i < len(nodes) and nodes[i]["ts"] < run["ts"] + run["dur"]:
            if nodes[i]["ts"] >= run["ts"]:
                inside.append(nodes[i])
            i += 1
        out.append((run, inside))
    return out


def tally(sessions: dict[str, list[tuple[dict, list[dict]]]], steps: int) -> dict:
    """Microseconds per token by operator kind, by operator and by call, over the last `steps` decoding steps: each
    session runs once a step, so its last `steps` runs (a session with fewer, such as a prefill's, ran none)."""
    kinds, ops, calls, counts = (collections.Counter() for _ in range(4))
    for name, runs in sessions.items():
        if len(runs) < steps:
            continue
        for run, nodes in runs[-steps:]:
            calls[name] += run["dur"]
            for node in nodes:
                op = node["args"]["op_name"]
                ops[op] += node["dur"]
                counts[op] += 1
                kinds[kind_of(op, node["name"])] += node["dur"]

    def per(counter: collections.Counter) -> dict:
        return {k: round(v / steps, 1) for k, v in counter.most_common()}

    return {
        "kinds": per(kinds),
        "ops": per(ops),
        "op_counts_per_token": {k: round(v / steps, 1) for k, v in counts.most_common()},
        "calls": per(calls),
        "run_us": round(sum(calls.values()) / steps, 1),
    }


def ours(path: str, tokens: int, folder: str) -> dict:
    from paradecode.runtime.backends import onnxruntime_backend

    backend_class = onnxruntime_backend.OnnxRuntimeBackend

    def decode(model) -> tuple[list[float], list[int]]:
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
        ids = model.prompt_ids(messages=MESSAGES)
        token, _ = prefill(ctx, ids)
        position, walls, out = len(ids), [], [token]
        for _ in range(tokens):
            began = time.perf_counter()
            hidden = ctx.layers(MAIN, 1, ctx.num_layers, ctx.embed(MAIN, [token], position), position)
            token = ctx.head(MAIN, "final", hidden, position).token[0]
            walls.append(time.perf_counter() - began)
            position += 1
            out.append(token)
        return walls, out

    with load(path) as model:  # unprofiled: speed, and the row-exactness verdict cached for the profiled load
        decode(model)
        walls, reference = decode(model)
        threads = model.backend.threads
    plain = backend_class._create_session

    def profiled(self, relative, stream=None, options=None):
        threads = options.intra_op_num_threads if options is not None else self.threads
        fresh = self._options(threads)
        fresh.enable_profiling = True
        fresh.profile_file_prefix = f"{folder}/ours-{Path(relative).stem}-{threads}"
        return plain(self, relative, stream, options=fresh)

    backend_class._create_session = profiled
    try:
        with load(path) as model:
            profiled_walls, out = decode(model)
            assert out == reference, "the profiled run decoded other tokens"
            names = {id(s): n for n, s in model.backend.sessions.items()}
            files = {}
            for session in model.backend.sessions.values():
                files[names[id(session)]] = session.end_profiling()
    finally:
        backend_class._create_session = plain
    sessions = {name: runs_of(json.loads(Path(f).read_text())) for name, f in files.items()}
    steps = tokens - DROPPED
    result = tally(sessions, steps)
    wall = statistics.median(profiled_walls[DROPPED:]) * 1e6
    result.update(
        wall_us_profiled=round(wall, 1),
        host_us=round(wall - result["run_us"], 1),
        calls_per_token=len(result["calls"]),
        tokens_per_s=round(1 / statistics.median(walls[DROPPED:]), 1),
        threads=threads,
    )
    return result


def peer(folder_path: str, tokens: int, folder: str, threads: int) -> dict:
    import onnxruntime_genai as og

    genai = Path(folder_path)
    config = json.loads((genai / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    options = ort.SessionOptions()
    for key, value in decoder.get("session_options", {}).items():
        if key == "intra_op_num_threads":
            continue
        if hasattr(options, key) and not isinstance(value, (dict, list)):
            setattr(options, key, value)
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    model = og.Model(str(genai))
    tokenizer = og.Tokenizer(model)
    prompt = tokenizer.apply_chat_template(json.dumps(MESSAGES), add_generation_prompt=True)
    ids = list(tokenizer.encode(prompt))

    def run_ort(sess) -> tuple[list[float], list[int]]:
        return decode_peer(sess, decoder, ids, tokens)

    plain_session = ort.InferenceSession(
        str(genai / decoder["filename"]), _unprofiled(options), providers=["CPUExecutionProvider"]
    )
    run_ort(plain_session)
    walls, reference = run_ort(plain_session)
    options.enable_profiling = True
    options.profile_file_prefix = f"{folder}/peer"
    session = ort.InferenceSession(str(genai / decoder["filename"]), options, providers=["CPUExecutionProvider"])
    profiled_walls, out = run_ort(session)
    assert out == reference, "the profiled run decoded other tokens"
    runs = runs_of(json.loads(Path(session.end_profiling()).read_text()))
    steps = tokens - DROPPED
    result = tally({"model": runs}, steps)
    wall = statistics.median(profiled_walls[DROPPED:]) * 1e6
    # onnxruntime-genai's own loop: the same prompt and tokens, its config's threads set to THREADS
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + tokens + 1, do_sample=False)
    generator_walls = []
    for _ in range(2):
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator_walls = []
        while not generator.is_done():
            began = time.perf_counter()
            generator.generate_next_token()
            generator_walls.append(time.perf_counter() - began)
    generated = list(generator.get_sequence(0))[len(ids) :]
    genai_wall = statistics.median(generator_walls[1 + DROPPED :]) * 1e6
    result.update(
        wall_us_profiled=round(wall, 1),
        host_us_plain_ort=round(wall - result["run_us"], 1),
        genai_wall_us=round(genai_wall, 1),
        genai_host_us=round(genai_wall - result["run_us"], 1),  # its loop's wall less the graph's profiled run
        genai_tokens_per_s=round(1e6 / genai_wall, 1),
        plain_ort_tokens_per_s=round(1 / statistics.median(walls[DROPPED:]), 1),
        same_tokens_as_genai=generated[: len(reference)] == reference[: len(generated)],
        threads=threads,
        session_options=decoder.get("session_options", {}),
    )
    return result


def decode_peer(sess, decoder: dict, ids: list[int], tokens: int, forced: list[int] | None = None):
    """The peer's graph decoding `ids`' continuation greedily for `tokens` steps after its prefill, fed as
    onnxruntime-genai feeds it on a CPU (past key/values in, present out); `forced`: the tokens to feed instead of
    its own. Returns each step's wall time (the prefill's left out) and the tokens it chose."""
    inputs = {i.name for i in sess.get_inputs()}
    layers, kv, head_dim = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    past = {
        f"past_key_values.{i}.{kind}": np.zeros((1, kv, 0, head_dim), np.float32)
        for i in range(layers)
        for kind in ("key", "value")
    }
    names = [o.name for o in sess.get_outputs()]
    feed_ids, out, walls, length = ids, [], [], 0
    for step in range(tokens + 1):
        began = time.perf_counter()
        feeds = {"input_ids": np.array([feed_ids], np.int64), **past}
        length += len(feed_ids)
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, length), np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(length - len(feed_ids), length, dtype=np.int64)[None]
        values = dict(zip(names, sess.run(names, feeds)))
        token = int(values["logits"][0, -1].argmax())
        past = {
            name.replace("present", "past_key_values"): v for name, v in values.items() if name.startswith("present")
        }
        if step:
            walls.append(time.perf_counter() - began)
        out.append(token)
        feed_ids = [forced[step] if forced and step < len(forced) else token]
    return walls, out


def _unprofiled(options: ort.SessionOptions) -> ort.SessionOptions:
    fresh = ort.SessionOptions()
    fresh.intra_op_num_threads = options.intra_op_num_threads
    fresh.inter_op_num_threads = options.inter_op_num_threads
    fresh.log_severity_level = 3
    return fresh


def main() -> None:
    export, genai, out = sys.argv[1:4]
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    folder = tempfile.mkdtemp(prefix="op-table-")
    torch.set_num_threads(1)
    result = {"export": export, "genai": genai, "tokens": tokens, "dropped": DROPPED}
    result["ours"] = ours(export, tokens, folder)
    result["peer"] = peer(genai, tokens, folder, threads)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {
                side: {k: v for k, v in result[side].items() if k not in ("ops", "op_counts_per_token")}
                for side in ("ours", "peer")
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
