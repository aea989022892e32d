"""The peers' perplexity on the text `paradecode-perplexity` scores, through their own graphs: onnxruntime-genai's
model (its `model.onnx` run by onnxruntime with an empty past, a window a call), llama.cpp on the GGUF
(llama-cpp-python, every position's logits) and OpenVINO's models from optimum-intel (the `openvino_model.xml` the
openvino peer's LLMPipeline runs, compiled by OpenVINO's CPU plugin with its default hints, as the pipeline's are:
its state reset before each window).

    python tools/results/cpu-2core/peer-perplexity.py EXPORT [--genai FOLDER] [--gguf FILE] [--openvino FOLDER ...]
        [--json OUT]

EXPORT gives the token ids (its tokenizer on the `eval` text, the first 6,144 tokens, as paradecode-perplexity
reads them) and the windows (512 tokens, a window's first token context only), so every figure scores the same
tokens the same way as `paradecode-perplexity EXPORT` does. Prints each peer's perplexity and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from paradecode.runtime import load
from paradecode.tools.perplexity import DEFAULT_TEXT, DEFAULT_TOKENS, DEFAULT_WINDOW, text_of


def windows(ids: list[int], window: int):
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) >= 2:
            yield chunk


def negative_logprob(logits: np.ndarray, chunk: list[int]) -> float:
    """Sum over the window's scored tokens of -log p(token), from logits [positions, vocab]."""
    logits = logits[:-1].astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -float(logprobs[np.arange(len(chunk) - 1), chunk[1:]].sum())


def genai_logits(folder: Path):
    import onnxruntime as ort

    config = json.loads((folder / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    session = ort.InferenceSession(str(folder / decoder["filename"]), options, providers=["CPUExecutionProvider"])
    kv_heads, head_size = decoder["num_key_value_heads"], decoder["head_size"]

    def run(chunk: list[int]) -> np.ndarray:
        n = len(chunk)
        feeds = {}
        for spec in session.get_inputs():
            if spec.name == "input_ids":
                feeds[spec.name] = np.array([chunk], np.int64)
            elif spec.name == "attention_mask":
                feeds[spec.name] = np.ones((1, n), np.int64)
            elif spec.name == "position_ids":
                feeds[spec.name] = np.arange(n, dtype=np.int64)[None]
            elif spec.name.startswith("past_key_values"):
                feeds[spec.name] = np.zeros((1, kv_heads, 0, head_size), np.float32)
            else:
                raise SystemExit(f"onnxruntime-genai's graph has an input this script does not know: {spec.name}")
        return session.run(["logits"], feeds)[0][0]

    return run


def llama_cpp_logits(gguf: Path, window: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=window, n_batch=window, logits_all=True, n_threads=2, verbose=False)

    def run(chunk: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(chunk)
        return np.array(llm.scores[: len(chunk)])

    return run


def openvino_logits(folder: Path):
    import openvino as ov

    compiled = ov.Core().compile_model(str(folder / "openvino_model.xml"), "CPU", {"INFERENCE_NUM_THREADS": 2})
    request = compiled.create_infer_request()
    names = {port.get_any_name() for port in compiled.inputs}

    def run(chunk: list[int]) -> np.ndarray:
        n = len(chunk)
        request.reset_state()
        feeds = {
            "input_ids": np.array([chunk], np.int64),
            "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, np.int32),
        }
        unknown = names - set(feeds)
        if unknown:
            raise SystemExit(f"the OpenVINO model has inputs this script does not know: {sorted(unknown)}")
        request.infer({name: feeds[name] for name in names})
        return np.array(request.get_tensor("logits").data[0], np.float32)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--genai", type=Path, help="onnxruntime-genai's model folder (its genai_config.json)")
    parser.add_argument("--gguf", type=Path, help="the GGUF file llama.cpp runs")
    parser.add_argument(
        "--openvino", type=Path, action="append", default=[], help="an OpenVINO model folder (its openvino_model.xml)"
    )
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with load(args.export) as model:
        ids = model.tokenizer.encode(text_of(DEFAULT_TEXT))[:DEFAULT_TOKENS]
    peers = {}
    if args.genai:
        peers[f"onnxruntime-genai {args.genai}"] = genai_logits(args.genai)
    if args.gguf:
        peers[f"llama.cpp {args.gguf.name}"] = llama_cpp_logits(args.gguf, args.window)
    for folder in args.openvino:
        peers[f"openvino {folder}"] = openvino_logits(folder)
    results = []
    for name, logits_of in peers.items():
        started, total, count = time.perf_counter(), 0.0, 0
        for chunk in windows(ids, args.window):
            total += negative_logprob(logits_of(chunk), chunk)
            count += len(chunk) - 1
        results.append(
            {
                "peer": name,
                "tokens": count,
                "perplexity": math.exp(total / count),
                "seconds": time.perf_counter() - started,
            }
        )
        print(f"{name}: perplexity {results[-1]['perplexity']:.3f} over {count} tokens", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"text": DEFAULT_TEXT, "window": args.window, "results": results}, indent=2))


if __name__ == "__main__":
    main()
