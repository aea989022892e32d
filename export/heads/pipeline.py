"""`train_exit_heads`: a Hugging Face causal LM -> a heads file with distilled, speed-calibrated exit heads.

Order of work: every check that can refuse the request (output file, model, exit layers, vocabulary
budget, prompts, the export `--costs` names, which is timed then: its costs depend on the vocabulary's
size only) runs before the model generates anything. Then: held-out sequences are chosen;
the model continues the prompts greedily in batches while hooks record what training needs
(`data`); the reduced vocabulary is ranked from the training sequences (`vocab`); the heads start
from the least-squares map and are distilled (`training`); the held-out positions measure the
agreement, untrained and trained; the call costs are measured (`timing`) unless an export's were;
half of the held-out sequences choose the exit layers and thresholds for speed (`calibration`), the other half checks
the expected speedup of that choice. The heads file is written last, atomically.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from paradecode.graphs.arguments import SEED_RANGE
from paradecode.graphs.errors import OutputNotWrittenError, UserInputError
from paradecode.graphs.untrusted import show

logger = logging.getLogger(__name__)

COSTS = ("measured", "parameters")


@dataclass(frozen=True)
class HeadsConfig:
    """What `paradecode-train-heads` is asked to do; the defaults keep a SmolLM2-135M run on a 2-core CPU
    within 10 minutes (see docs/export.md, *Train exit heads*)."""

    model: str
    output: Path
    exit_layers: tuple[int, ...] | None = None  # default: the export's, L/4, L/2, 3L/4
    prompts: str | Path | None = None  # a file or a prompt set's name (`export.prompt_sets`); default: DEFAULT_PROMPTS
    text: Path | None = None  # train on this text's windows instead of generations
    max_prompts: int = 120  # a larger prompt set is sampled down to this many (seeded)
    new_tokens: int = 128  # greedy tokens per prompt
    generation_batch: int = 32  # prompts generated at once
    window: int = 256  # tokens per --text window
    steps: int = 100  # Adam steps
    lr: float = 1e-3
    batch: int = 512  # positions per step
    held_out: float = 0.2  # share of sequences held out (half choose the thresholds, half check them)
    head_budget: float = 1.0  # a head may read at most this many decoder layers' parameters
    # "measured": time graphs traced from the model's spec (float32) here; "parameters": estimate from parameter
    # counts; an export folder of this model (`costs_export`): time its own graphs here (quantization, operators)
    costs: str | Path = "measured"
    seed: int = 0
    force: bool = False

    def __post_init__(self) -> None:
        if self.prompts is not None and self.text is not None:
            raise UserInputError("give --prompts or --text, not both.")
        for name in ("max_prompts", "new_tokens", "generation_batch", "window", "batch"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise UserInputError(f"{name} must be a positive integer, got {value!r}.")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise UserInputError(
                f"steps must be a positive integer, got {self.steps!r}: without a training step the heads file would "
                "hold untrained heads. Pass --steps 1 or more."
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserInputError(f"--lr must be a positive number, got {self.lr}.")
        low, high = SEED_RANGE
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= high):
            raise UserInputError(
                f"seed must be an integer from 0 to {high} (2**64 - 1, what torch's generators take), got "
                f"{show(self.seed)}; paradecode-train-heads --seed takes {low} to {high} and wraps a negative one."
            )
        if not 0 < self.held_out < 1:
            raise UserInputError(f"--held-out must be a share in (0, 1), got {self.held_out}.")
        if not (math.isfinite(self.head_budget) and self.head_budget > 0):
            raise UserInputError(f"--head-budget must be a positive number of decoder layers, got {self.head_budget}.")
        if self.costs_export is not None and (self.costs == "" or not self.costs_export.is_dir()):
            what = "is a file" if self.costs_export.is_file() else "is no such folder"
            raise UserInputError(
                f"--costs {self.costs}: expected {' or '.join(COSTS)}, or an export folder of this model (the one "
                f"holding manifest.json) whose graphs are timed here; {self.costs or 'an empty path'} {what}."
            )
        from paradecode.export.prompt_sets import is_evaluation_set

        if self.prompts is not None and is_evaluation_set(self.prompts):
            raise UserInputError(
                f"--prompts {self.prompts} is the held-out evaluation set, which heads never train on (it measures "
                "them): train on the training set, --prompts heads, or on a file of your own."
            )

    @property
    def costs_export(self) -> Path | None:
        """The export whose graphs are timed for the calibration, or None (`measured` or `parameters`; a folder
        named like one of them is given as ./measured)."""
        return None if self.costs in COSTS else Path(self.costs)

    @classmethod
    def default(cls, name: str):
        return next(f.default for f in fields(cls) if f.name == name)


@dataclass
class HeadsTraining:
    """What a run made and measured; `metadata` is what the heads file records."""

    transforms: dict[int, torch.Tensor]
    vocab: torch.Tensor
    metadata: dict[str, Any]
    history: list[dict[str, Any]]


def prompt_ids_of(tokenizer, prompts: list, model: str) -> list[list[int]]:
    """Every prompt's token ids: a text with the tokenizer's special tokens, a chat (a list of messages)
    rendered with the tokenizer's chat template and encoded as it is (as `apply_chat_template` does)."""
    import jinja2

    ids = []
    for number, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt)["input_ids"])
            continue
        where = f"prompt {number} (of {len(prompts)})"
        if tokenizer.chat_template is None:
            raise UserInputError(
                f"{where} is a chat, but the tokenizer of {model} has no chat template: give its text as "
                '{"prompt": "..."} instead.'
            )
        try:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as err:
            raise UserInputError(f"{where}: the chat template of {model} refused its messages: {err}") from err
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def record(config: HeadsConfig, text: str | None, source, model, family, spec, exit_layers, generator):
    """The recording to learn from: generations of the prompts (or the windows of `text`, --text's), and its
    description."""
    from paradecode.export.heads.data import DEFAULT_PROMPTS, generate_features, held_out_sequences, text_features
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.export.tokenizer import hf_tokenizer

    tokenizer = hf_tokenizer(source)
    if config.text is not None:
        if tokenizer is None:
            raise UserInputError(f"{config.model} has no tokenizer to read --text with.")
        ids = tokenizer(text)["input_ids"]
        windows = [ids[i : i + config.window] for i in range(0, len(ids) - 1, config.window)]
        windows = [w for w in windows if len(w) > 1]
        check_sequences(len(windows))
        held = held_out_sequences(len(windows), config.held_out, config.seed)
        with logging_redirect_tqdm(), tqdm(total=len(windows), desc="recording text", unit="window") as bar:
            recording = text_features(model, family, spec, windows, exit_layers, held, progress=bar.update)
        return recording, {"kind": "text", "file": str(config.text), "windows": len(windows)}
    if config.prompts is not None:
        if tokenizer is None:
            raise UserInputError(f"{config.model} has no tokenizer to read --prompts with.")
        texts = [p.prompt for p in load_prompts(config.prompts)]
    else:
        texts = list(DEFAULT_PROMPTS)
    available = len(texts)
    if available > config.max_prompts:  # a seeded sample, in the file's order
        keep = torch.randperm(available, generator=torch.Generator().manual_seed(config.seed))[: config.max_prompts]
        texts = [texts[i] for i in sorted(keep.tolist())]
        logger.info("using %d of the %d prompts (--max-prompts)", len(texts), available)
    if tokenizer is not None:
        prompts = prompt_ids_of(tokenizer, texts, config.model)
    else:  # a model without a tokenizer: random short prompts
        prompts = [torch.randint(0, spec.vocab_size, (4,), generator=generator).tolist() for _ in texts]
    check_sequences(len(prompts))
    held = held_out_sequences(len(prompts), config.held_out, config.seed)
    batches = math.ceil(len(prompts) / config.generation_batch)
    logger.info(
        "generating greedy continuations of %d prompts (%d tokens of prompt in all), %d tokens each, %d at a time",
        len(prompts),
        sum(map(len, prompts)),
        config.new_tokens,
        config.generation_batch,
    )
    with logging_redirect_tqdm(), tqdm(total=batches * config.new_tokens, desc="generating", unit="step") as bar:
        recording = generate_features(
            model,
            family,
            spec,
            prompts,
            exit_layers,
            held,
            new_tokens=config.new_tokens,
            batch=config.generation_batch,
            progress=bar.update,
        )
    data = {
        "kind": "generations",
        "prompts": str(config.prompts) if config.prompts else "built-in",
        "prompts_available": available,
        "sequences": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "new_tokens": config.new_tokens,
    }
    return recording, data


def check_sequences(count: int) -> None:
    if count < 2:
        raise UserInputError(
            f"need at least two sequences (one to train on, one held out), got {count}; give more prompts or text."
        )


def split_check(held_out: torch.Tensor, sequence: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out positions as two sets of whole sequences: one chooses the thresholds, the other checks them.
    With a single held-out sequence both are that sequence (the check is then in-sample)."""
    from paradecode.export.heads.data import held_out_sequences

    chosen = torch.unique(sequence[held_out])
    if len(chosen) < 2:
        rows = torch.nonzero(held_out).squeeze(1)
        return rows, rows
    check = chosen[held_out_sequences(len(chosen), 0.5, (seed + 1) % 2**64)]  # the seed's successor, in range
    in_check = torch.isin(sequence, check)
    return torch.nonzero(held_out & ~in_check).squeeze(1), torch.nonzero(held_out & in_check).squeeze(1)


def train_exit_heads(config: HeadsConfig) -> HeadsTraining:
    from transformers.utils import logging as hf_logging

    from paradecode.export.config import default_exit_layers
    from paradecode.export.families import family_for
    from paradecode.export.heads.calibration import calibrate, expected_speedup
    from paradecode.export.heads.call_costs import call_costs_from_export, call_costs_from_spec, check_costs_export
    from paradecode.export.heads.cost_model import CostModel
    from paradecode.export.heads.file import save_heads
    from paradecode.export.heads.training import Unembedding, evaluate_heads, least_squares_init, train_heads
    from paradecode.export.heads.vocab import frequent_tokens, head_parameters, layer_parameters, vocab_budget
    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.source import resolve_model

    started = time.perf_counter()
    hf_logging.disable_progress_bar()
    from paradecode.export.files import check_file_writable
    from paradecode.export.prompt_files import read_text_file

    check_file_writable(config.output, "-o")  # a folder, or a path that cannot be written: refused before the run
    if config.output.exists() and not config.force:
        raise UserInputError(f"{config.output} exists. Pass --force to replace it.")
    text = read_text_file(config.text, "--text") if config.text is not None else None
    source = resolve_model(config.model)
    family = family_for(source.config_dict().get("model_type"))
    model = load_hf_model(source)
    spec = family.spec(model.config, model)
    exit_layers = tuple(sorted(set(config.exit_layers))) if config.exit_layers else default_exit_layers(spec.num_layers)
    bad = [e for e in exit_layers if not 1 <= e < spec.num_layers]
    if bad:
        raise UserInputError(f"exit layers {bad} are out of range: choose layers within 1..{spec.num_layers - 1}.")
    size = vocab_budget(spec, config.head_budget)
    identity = source.identity()  # the same identity paradecode-export computes and check_heads compares
    seconds: dict[str, float] = {"load": time.perf_counter() - started}
    costs_source, call_costs = config.costs, None
    if config.costs_export is not None:  # refused or timed before the long work (the costs depend on `size` only)
        costs_source = check_costs_export(config.costs_export, identity, spec, size)
        clock = time.perf_counter()
        call_costs = call_costs_from_export(config.costs_export)
        seconds["timing"] = time.perf_counter() - clock
    generator = torch.Generator().manual_seed(config.seed)

    clock = time.perf_counter()
    recording, data = record(config, text, source, model, family, spec, exit_layers, generator)
    features, held_out = recording.features, recording.held_out
    seconds["data"] = time.perf_counter() - clock
    if not held_out.any() or held_out.all():
        raise UserInputError(
            "the training or the held-out sequences have no positions (their continuations ended at once); "
            "give more prompts."
        )
    train_rows = torch.nonzero(~held_out).squeeze(1)
    vocab = frequent_tokens(features.token[train_rows], recording.soft_counts, size)
    layer = layer_parameters(spec)
    data.update(
        positions=len(features),
        held_out_positions=int(held_out.sum()),
        features_mb=round(features.nbytes() / 2**20, 1),
        seconds=round(seconds["data"], 1),
    )
    coverage = float(torch.isin(features.token[held_out], vocab).float().mean())
    vocab_info = {
        "size": len(vocab),
        "budget_layers": config.head_budget,
        "head_parameters": head_parameters(spec, len(vocab)),
        "layer_parameters": layer,
        "head_layers_by_parameters": round(head_parameters(spec, len(vocab)) / layer, 4),
        "final_head_layers_by_parameters": round(spec.vocab_size * spec.hidden_size / layer, 4),
        "top1_tokens_in_training": len(torch.unique(features.token[train_rows])),
        "held_out_coverage": round(coverage, 4),
    }
    logger.info(
        "%d positions (%d held out, %.1f MiB of features); reduced vocabulary: %d tokens (%d of them the final "
        "layer's top-1 in the training sequences), covering %.1f%% of held-out final tokens; a head reads %.2f "
        "layers' parameters",
        len(features),
        data["held_out_positions"],
        data["features_mb"],
        len(vocab),
        vocab_info["top1_tokens_in_training"],
        100 * coverage,
        vocab_info["head_layers_by_parameters"],
    )

    clock = time.perf_counter()
    unembedding = Unembedding.of(model, family)
    init = least_squares_init(unembedding, features, train_rows)
    with logging_redirect_tqdm(), tqdm(total=config.steps, desc="training", unit="step") as bar:

        def progress(info: dict[str, float]) -> None:
            bar.set_postfix(info, refresh=False)
            bar.update(1)

        transforms, history = train_heads(
            unembedding,
            features,
            held_out,
            vocab,
            steps=config.steps,
            lr=config.lr,
            batch=config.batch,
            seed=config.seed,
            log_every=max(1, config.steps // 4),
            init=init,
            progress=progress,
        )
    seconds["training"] = time.perf_counter() - clock

    clock = time.perf_counter()
    rows = torch.nonzero(held_out).squeeze(1)
    _, before = evaluate_heads(unembedding, features, rows, dict.fromkeys(exit_layers), None)
    confidence, agree = evaluate_heads(unembedding, features, rows, transforms, vocab)
    agreement = {
        str(e): {
            "untrained": round(float(before[e].float().mean()), 4),
            "trained": round(float(agree[e].float().mean()), 4),
        }
        for e in exit_layers
    }
    seconds["evaluation"] = time.perf_counter() - clock

    if config.costs == "parameters":
        cost, measured = CostModel.estimate(spec, len(vocab)), None
    else:
        if call_costs is None:
            clock = time.perf_counter()
            call_costs = call_costs_from_spec(spec, len(vocab))
            seconds["timing"] = time.perf_counter() - clock
        cost = CostModel.measured(spec.num_layers, call_costs)
        measured = call_costs.as_dict()
    calibration_rows, check_rows = split_check(held_out, features.sequence, config.seed)
    position = {int(r): i for i, r in enumerate(rows.tolist())}

    def at(values: dict[int, torch.Tensor], chosen: torch.Tensor) -> dict[int, torch.Tensor]:
        index = torch.tensor([position[int(r)] for r in chosen.tolist()], dtype=torch.int64)
        return {e: v[index] for e, v in values.items()}

    calibration = calibrate(at(confidence, calibration_rows), at(agree, calibration_rows), cost)
    calibration["check"] = {
        "positions": len(check_rows),
        "in_sample": bool(torch.equal(calibration_rows, check_rows)),
        "expected_speedup": round(
            expected_speedup(cost, at(confidence, check_rows), at(agree, check_rows), calibration["thresholds"]), 4
        ),
    }
    calibration["call_costs"] = measured
    calibration["costs"] = costs_source  # "measured", "parameters" or what the timed export is
    if measured is not None:
        layer_seconds = call_costs.layer[1]
        calibration["expected_tokens_per_s"] = {
            "ar": round(1 / (cost.ar() * layer_seconds), 2),
            "paradecode": round(calibration["expected_speedup"] / (cost.ar() * layer_seconds), 2),
        }
    seconds["total"] = time.perf_counter() - started
    metadata = {
        "base_model": identity["source"],
        "base_weights_sha256": identity["weights_sha256"],
        "data": data,
        "vocab": vocab_info,
        "training": {
            "init": "least squares",
            "loss": "the teacher's mass on the reduced vocabulary: its cross-entropy less its minimum",
            "steps": config.steps,
            "lr": config.lr,
            "batch": config.batch,
            "seed": config.seed,
            "final_loss": next((h["loss"] for h in reversed(history) if "loss" in h), None),
        },
        "agreement": agreement,
        "calibration": calibration,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    try:
        save_heads(config.output, transforms, metadata, vocab=vocab)
    except OSError as err:  # -o was checked before the run: its folder changed since, or the disk filled
        raise OutputNotWrittenError(
            f"-o {config.output} could not be written after training ({err.strerror or err}), so the heads are lost. "
            "Check the folder and the free space, then train again."
        ) from err
    return HeadsTraining(transforms, vocab, metadata, history)
