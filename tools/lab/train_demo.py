"""Train the demo model: a small Llama that writes Python, on the CPython standard library's source.

Every machine with Python has the data: the `.py` files under `sysconfig.get_paths()["stdlib"]`.
The script trains a byte-level BPE tokenizer on them, then a Llama-family model from scratch, and
writes a Hugging Face model folder (fp16 weights, tokenizer, config) plus `training.json` with
what was done (data, steps, losses). Files are held out by a fixed rule for the validation loss.

    python tools/lab/train_demo.py --output tools/demo_model --steps 1000 --threads 2

It is deterministic for a given Python version (the stdlib differs between versions) and seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

logger = logging.getLogger(__name__)

EOT = "<|endoftext|>"
# 9 layers of ~1M parameters (SwiGLU 4x): on a CPU a decode step is bound by reading weights, not by
# per-call overhead; a 2048-token vocabulary keeps an exit head at ~0.6 of a layer; ~19 MB in fp16.
MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=9,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=0,
    rope_theta=10000.0,
)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """The stdlib's .py files, sorted; every 40th is held out for validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held_out = files[::40]
    train = [p for i, p in enumerate(files) if i % 40]
    return train, held_out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((read(p) for p in files), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)])
    return tokenizer


def token_stream(tokenizer, files: list[Path]):
    import torch

    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer.encode(read(path)).ids)  # starts with <|endoftext|>: the document separator
    return torch.tensor(ids, dtype=torch.int64)


def batches(stream, batch: int, length: int, generator):
    import torch

    while True:
        starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=generator)
        yield torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def evaluate(model, stream, length: int, windows: int = 16) -> float:
    import torch

    step = max(1, (len(stream) - length - 1) // windows)
    losses = []
    with torch.no_grad():
        for start in range(0, step * windows, step):
            x = stream[start : start + length + 1][None]
            losses.append(float(model(x, labels=x).loss))
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/lab/train_demo.py", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_files, held_out = stdlib_files()
    logger.info(
        "data: %d training files, %d held out, from %s",
        len(train_files),
        len(held_out),
        sysconfig.get_paths()["stdlib"],
    )
    tokenizer = train_tokenizer(train_files, MODEL["vocab_size"])
    train = token_stream(tokenizer, train_files)
    valid = token_stream(tokenizer, held_out)
    logger.info("tokens: %d training, %d held out", len(train), len(valid))

    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    data = batches(train, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    history, started, running = [], time.time(), None
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x = next(data)
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % 50 == 0 or step == args.steps - 1:
            elapsed = time.time() - started
            entry = {"step": step, "train_loss": round(running, 4), "lr": lr_at(step), "seconds": round(elapsed)}
            if step % 300 == 0 or step == args.steps - 1:
                model.eval()
                entry["valid_loss"] = round(evaluate(model, valid, args.length), 4)
                model.train()
            history.append(entry)
            logger.info(
                "step %d/%d %s (%.0f tokens/s)",
                step,
                args.steps,
                entry,
                (step + 1) * args.batch * args.length / max(elapsed, 1e-9),
            )

    model.eval()
    args.output.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(args.output)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=None,
        model_max_length=MODEL["max_position_embeddings"],
    )
    fast.save_pretrained(args.output)
    summary = {
        "script": "python tools/lab/train_demo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "data": {
            "source": "CPython standard library .py files (sysconfig stdlib path), every 40th file held out",
            "train_files": len(train_files),
            "held_out_files": len(held_out),
            "train_tokens": len(train),
            "held_out_tokens": len(valid),
        },
        "model": {**MODEL, "parameters": params},
        "training": {
            "steps": args.steps,
            "batch": args.batch,
            "length": args.length,
            "lr": args.lr,
            "tokens_seen": args.steps * args.batch * args.length,
            "seconds": round(time.time() - started),
            "threads": args.threads,
            "seed": args.seed,
        },
        "final": history[-1],
        "history": history,
    }
    (args.output / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("wrote %s: final %s", args.output, history[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
