"""What the exact forms cost a token of plain decoding, unprofiled: our export's segments with a piece taken out,
beside the peer's graph (tools/results/cpu-2core/op-table.md, section 2026-11-28).

    python tools/results/cpu-2core/ablation.py GENAI_FOLDER OUT.json EXPORT [EXPORT ...]

Per export, two loads: as exported; without Q4_1's minima (each product's correction,
`export/quantized_products.py`, taken out: the products then compute other weights, so this is for timing only).
(Until 2026-11-28 there were four: the attention's row copy, `export/exact_rows.py`, is gone with the attention of
standard operators, which needs none.) Every load is fed the same tokens (the exported load's greedy continuation of
a chat prompt, whatever a load's own head says), so each computes the same positions. The peer's graph (onnxruntime-
genai's builder output on 2 threads, fed as `op-table.py` feeds it) decodes the same number of tokens in the same
rounds. Rounds interleave every load and the peer; per load, the median wall time of a token in each round, then the
median, min and max over rounds. The pieces overlap and the runs are noisy (identical graphs loaded twice differed
by up to 1 ms a token here), so differences between loads are not additive.
"""

import contextlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import onnx
import onnxruntime as ort
import torch
from onnx import helper

from paradecode.runtime import load
from paradecode.runtime.decoding import MAIN, DecodeContext, prefill
from paradecode.runtime.tracing import Timeline

TOKENS, DROPPED, ROUNDS = 64, 4, 5
VARIANTS = {"as exported": (), "no minima": ("minima",)}

_spec = importlib.util.spec_from_file_location("op_table", Path(__file__).with_name("op-table.py"))
op_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_table)


def without(data: bytes, pieces: tuple[str, ...]) -> bytes:
    """The graph with `pieces` taken out: an output that adds a minima correction becomes its first input; nodes no
    output needs any more are dropped."""
    model = onnx.load_model_from_string(data)
    nodes = []
    for node in model.graph.node:
        out = node.output[0]
        minima = node.op_type == "Add" and any("/quant/correction" in name for name in node.input)
        if "minima" in pieces and minima:
            node = helper.make_node("Identity", [node.input[0]], [out])
        nodes.append(node)
    live, kept = {o.name for o in model.graph.output}, []
    for node in reversed(nodes):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    return model.SerializeToString()


def decode(model, forced: list[int] | None) -> tuple[list[float], list[int]]:
    ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
    ids = model.prompt_ids(messages=op_table.MESSAGES)
    token, _ = prefill(ctx, ids)
    position, walls, out = len(ids), [], [token]
    for step in range(TOKENS):
        began = time.perf_counter()
        hidden = ctx.layers(
            MAIN, 1, ctx.num_layers, ctx.embed(MAIN, [forced[step] if forced else token], position), position
        )
        token = ctx.head(MAIN, "final", hidden, position).token[0]
        walls.append(time.perf_counter() - began)
        position += 1
        out.append(token)
    return walls[DROPPED:], out


def main() -> None:
    genai, out_path, exports = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    decoder = json.loads((genai / "genai_config.json").read_text())["model"]["decoder"]
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    peer = ort.InferenceSession(str(genai / decoder["filename"]), options, providers=["CPUExecutionProvider"])
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(og.Model(str(genai)))
    peer_ids = list(
        tokenizer.encode(tokenizer.apply_chat_template(json.dumps(op_table.MESSAGES), add_generation_prompt=True))
    )
    with contextlib.ExitStack() as stack:
        loads, forced = {}, {}
        for export in exports:
            for variant, pieces in VARIANTS.items():
                model = stack.enter_context(load(export))
                for name in list(model.backend.graphs):
                    if pieces and Path(name).stem.startswith("segment_"):
                        model.backend.graphs[name] = without(model.backend.graphs[name], pieces)
                loads[(export, variant)] = model
            forced[export] = decode(loads[(export, "as exported")], None)[1][:TOKENS]
        for (export, _), model in loads.items():  # warm: sessions made, buffers bound
            decode(model, forced[export])
        decode_peer = op_table.decode_peer
        decode_peer(peer, decoder, peer_ids, TOKENS)
        medians: dict[str, list[float]] = {}
        for _ in range(ROUNDS):
            for (export, variant), model in loads.items():
                medians.setdefault(f"{export} | {variant}", []).append(
                    statistics.median(decode(model, forced[export])[0])
                )
            medians.setdefault("onnxruntime-genai int4 graph | plain onnxruntime, 2 threads", []).append(
                statistics.median(decode_peer(peer, decoder, peer_ids, TOKENS)[0][DROPPED:])
            )
    rows = {
        key: {
            "ms_per_token": round(statistics.median(values) * 1e3, 3),
            "ms_min": round(min(values) * 1e3, 3),
            "ms_max": round(max(values) * 1e3, 3),
            "tokens_per_s": round(1 / statistics.median(values), 1),
        }
        for key, values in medians.items()
    }
    Path(out_path).write_text(
        json.dumps({"tokens": TOKENS, "dropped": DROPPED, "rounds": ROUNDS, "rows": rows}, indent=1) + "\n"
    )
    print("| export | load | ms a token (min-max) | tokens/s |\n| --- | --- | ---: | ---: |")
    for key, row in rows.items():
        export, variant = key.split(" | ")
        print(
            f"| {export} | {variant} | {row['ms_per_token']:.2f} ({row['ms_min']:.2f}-{row['ms_max']:.2f}) "
            f"| {row['tokens_per_s']} |"
        )


if __name__ == "__main__":
    main()
