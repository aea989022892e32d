"""`train_draft_head`: an export -> a draft-head file trained on the export's own sequences, with its acceptance.

Order of work: every check that can refuse the request (output file, export, prompts, texts, corpora) runs before
anything is recorded. Then: the jobs (each prompt's greedy answer and `samples - 1` sampled ones; apart from them the
texts' windows and the corpora's chats, export/draft/corpora.py) and the held-out prompts (whose every sequence is
kept from training; their greedy answers measure acceptance); the data is recorded into `--data`'s shards, in three
series, going on after any a run left there (export/draft/data.py): the answers (`--max-shards`: their first shards
alone: the held-out answers, then the other jobs in a seeded order), the texts (`--max-texts`: a seeded sample),
the greedy answers to `--written N` prompts the model writes (export/draft/written.py); answers first, so the
held-out ones are the data's first sequences; the reduced vocabulary is the most frequent final-head choices in the
training answers (the model's own words: the answers and the written prompts', not the texts'); a head is trained
at each data size asked for (a share of the training sequences: the acceptance curve says whether more data would
pay) and measured on the held-out answers; the largest size's head is written last, atomically, with the
measurements in its metadata.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from paradecode.export.draft.data import TEXTS, WRITTEN, Job, load_data, record
from paradecode.export.draft.training import TrainingConfig, acceptance, coverage, draft_of, train
from paradecode.export.draft_head import feature_layers
from paradecode.graphs.errors import OutputNotWrittenError, UserInputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftConfig:
    """What `paradecode-train-draft` is asked to do."""

    export: Path
    output: Path
    data: Path  # the shards' folder (resumable)
    prompts: str | Path = "heads"
    texts: tuple[Path, ...] = ()
    corpora: tuple[str, ...] = ()  # corpora by name (export/draft/corpora.py), teacher-forced as chats
    max_texts: int | None = None  # a seeded sample of this many of the texts' and corpora's sequences
    written: int = 0  # prompts the model writes itself, then answers (export/draft/written.py)
    samples: int = 1  # answers per prompt: the greedy one, then sampled ones (seeded)
    temperature: float = 0.8  # of the sampled answers
    new_tokens: int = 256
    text_chars: int = 1500  # a text is cut into windows of about this many characters
    max_prompts: int | None = None
    max_shards: int | None = None  # record and train on the first shards only (a later run with more goes on)
    shard_size: int = 32  # sequences per shard
    vocab: int = 4096
    held_out: float = 0.1  # share of prompts held out
    sizes: tuple[float, ...] = (1.0,)  # shares of the training sequences to train a head on, each
    training: TrainingConfig = field(default_factory=TrainingConfig)
    seed: int = 0
    force: bool = False

    def __post_init__(self):
        if self.samples < 1:
            raise UserInputError(f"--samples must be at least 1 (the greedy answer), got {self.samples}.")
        if not 0 < self.held_out < 1:
            raise UserInputError(f"--held-out must be between 0 and 1 (a share of prompts), got {self.held_out}.")
        if not self.sizes or any(not 0 < s <= 1 for s in self.sizes):
            raise UserInputError(f"--sizes must be shares in (0, 1] of the training data, got {list(self.sizes)}.")
        if self.vocab < 2:
            raise UserInputError(f"--vocab must be at least 2 tokens, got {self.vocab}.")


@dataclass
class SizeResult:
    share: float
    sequences: int
    positions: int
    seconds: float
    acceptance: dict
    history: list[dict]


@dataclass
class DraftResult:
    output: Path
    vocab: int
    coverage: float
    untrained: dict
    sizes: list[SizeResult]


def held_out_prompt(index: int, share: float, seed: int) -> bool:
    """Whether prompt `index` is held out: by a digest of the seed and index, so the split never depends on order."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def jobs_of(config: DraftConfig) -> tuple[list[Job], list[int]]:
    """The answers' jobs, and the indices of the held-out prompts' greedy answers among them: those come first, so
    that the first shards (`--max-shards`) hold all of them and every data size is measured on the same answers; the
    others follow in a seeded order, so that any first shards sample every category. A held-out prompt gives no
    other job (its sampled answers would be training data on it)."""
    from paradecode.export.prompt_sets import is_evaluation_set, load_prompts

    if is_evaluation_set(config.prompts):
        raise UserInputError("--prompts eval is the held-out evaluation set, which nothing trains on; use heads.")
    prompts = [p.prompt for p in load_prompts(config.prompts)]
    if config.max_prompts is not None and len(prompts) > config.max_prompts:
        chosen = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(config.seed))
        prompts = [prompts[i] for i in sorted(chosen[: config.max_prompts].tolist())]
    held, jobs = [], []
    for i, prompt in enumerate(prompts):
        if held_out_prompt(i, config.held_out, config.seed):
            held.append(Job(prompt=prompt))
            continue
        jobs.append(Job(prompt=prompt))
        jobs += [
            Job(prompt=prompt, temperature=config.temperature, seed=config.seed * 1000 + s)
            for s in range(1, config.samples)
        ]
    order = torch.randperm(len(jobs), generator=torch.Generator().manual_seed(config.seed)).tolist()
    return held + [jobs[i] for i in order], list(range(len(held)))


def text_jobs_of(config: DraftConfig) -> list[Job]:
    """The texts' jobs: each `--text` file's windows of `text_chars` characters, then each corpus's chats (a text
    longer than `text_chars` cut there), in a seeded order (`max_texts`: the first of them)."""
    from paradecode.export.draft.corpora import corpus_jobs
    from paradecode.export.prompt_files import read_text_file

    jobs = []
    for path in config.texts:
        text = read_text_file(path, "--text")
        jobs += [Job(text=text[a : a + config.text_chars]) for a in range(0, len(text), config.text_chars)]
    for name in config.corpora:
        jobs += [Job(prompt=job.prompt, text=job.text[: config.text_chars]) for job in corpus_jobs(name)]
    order = torch.randperm(len(jobs), generator=torch.Generator().manual_seed(config.seed)).tolist()
    return [jobs[i] for i in order[: config.max_texts]]


def written_jobs(model, config: DraftConfig, training: list[Job]) -> list[Job]:
    """The greedy answers to `config.written` prompts the model writes, shown the training jobs' prompts."""
    from paradecode.export.draft.written import examples_of, write_prompts

    examples = examples_of([job.prompt for job in training if job.temperature == 0])
    prompts = write_prompts(model, examples, config.written, config.data, config.seed)
    chat = model.chat_template is not None
    return [Job(prompt=[{"role": "user", "content": text}] if chat else text) for text in prompts]


def sequences_in(paths: list) -> int:
    """How many sequences the shards at `paths` hold, read from their `starts` alone."""
    from safetensors import safe_open

    total = 0
    for path in paths:
        with safe_open(str(path), "pt") as f:
            total += f.get_slice("starts").get_shape()[0] - 1
    return total


def export_weights(model) -> dict[str, torch.Tensor]:
    """The export's canonical weights, quantized ones dequantized: what its graphs compute with."""
    from safetensors.torch import load

    from paradecode.graphs.quantized_weights import dequantized

    backend = model.backend
    return dequantized(load(backend.export.read(backend.manifest.weights)), backend.manifest.quantization)


def train_draft_head(config: DraftConfig) -> DraftResult:
    from paradecode.export.draft_head import save_draft_head, untrained_draft_head
    from paradecode.export.heads.vocab import frequent_tokens
    from paradecode.runtime import load

    if config.output.exists() and not config.force:
        raise OutputNotWrittenError(f"{config.output} exists; pass --force to overwrite it.")
    if config.output.is_dir():
        raise UserInputError(f"-o {config.output} is a folder; give the draft-head file's path.")
    jobs, held = jobs_of(config)
    texts = text_jobs_of(config)
    model = load(config.export, backend="onnxruntime")
    try:
        spec = model.backend.spec
        shards = dict(shard_size=config.shard_size, new_tokens=config.new_tokens)
        paths = record(model, jobs, config.data, limit=config.max_shards, progress=_recorded("answers"), **shards)
        text_paths = []
        if texts:
            text_paths = record(model, texts, config.data, series=TEXTS, progress=_recorded("texts"), **shards)
        written_paths = []
        if config.written:
            asked = written_jobs(model, config, jobs[len(held) :])
            written_paths = record(model, asked, config.data, series=WRITTEN, progress=_recorded("written"), **shards)
        weights = export_weights(model)
        identity = model.manifest.model
    finally:
        model.close()
    data = load_data(paths + text_paths + written_paths)
    answers, texts_end = sequences_in(paths), sequences_in(paths + text_paths)
    held_set = {i for i in held if i < answers}
    evaluation = data.select(sorted(held_set))
    training = data.select([s for s in range(data.sequences) if s not in held_set])
    # the model's own words, where decoding guesses: the texts' choices would spend the vocabulary on a corpus's
    own = [s for s in [*range(answers), *range(texts_end, data.sequences)] if s not in held_set]
    own_targets = torch.cat([data.target[data.sequence(s)] for s in own]) if own else training.target
    if training.sequences == 0:
        raise UserInputError("no training sequences were recorded: give more prompts or a lower --held-out.")
    vocab = frequent_tokens(own_targets, torch.zeros(spec.vocab_size), min(config.vocab, spec.vocab_size))
    covered = coverage(vocab, evaluation)
    logger.info(
        "data: %d training sequences (%d positions), %d held out (%d answer positions); vocabulary of %d tokens "
        "covers %.1f%% of held-out answers",
        training.sequences,
        len(training),
        evaluation.sequences,
        covered.positions,
        len(vocab),
        100 * covered.share,
    )
    depth, features = config.training.depth, config.training.features

    def fresh():
        return draft_of(spec, weights, untrained_draft_head(spec, vocab.tolist(), seed=config.seed), features=features)

    untrained = acceptance(fresh(), evaluation, depth)
    order = torch.randperm(training.sequences, generator=torch.Generator().manual_seed(config.seed)).tolist()
    results, draft = [], None
    for share in sorted(config.sizes):
        subset = training.select(order[: max(1, round(share * training.sequences))])
        draft = fresh()
        started = time.perf_counter()
        history = train(
            draft,
            subset,
            config.training,
            progress=_progress(share, config.training.steps),
            evaluate=lambda draft=draft: acceptance(draft, evaluation, depth),
        )
        seconds = time.perf_counter() - started
        measured = acceptance(draft, evaluation, depth)
        logger.info(
            "share %g (%d positions): accepted per chain %.3f, by depth %s",
            share,
            len(subset),
            measured.per_chain,
            [round(r, 3) for r in measured.rates],
        )
        results.append(SizeResult(share, subset.sequences, len(subset), round(seconds, 1), measured.to_dict(), history))
    metadata = {
        "base_export": str(config.export),
        "base_weights_sha256": identity["weights_sha256"],
        "trained": True,
        "vocab_coverage": round(covered.share, 4),
        "training": asdict(config.training),
        "untrained": untrained.to_dict(),
        "sizes": [{k: v for k, v in asdict(r).items() if k != "history"} for r in results],
    }
    if config.training.features:
        metadata["feature_layers"] = list(feature_layers(spec.num_layers))
    save_draft_head(config.output, draft.tensors(), metadata)
    return DraftResult(config.output, len(vocab), covered.share, untrained.to_dict(), results)


def _recorded(series: str):
    def progress(index: int, shards: int, positions: int) -> None:
        logger.info("recorded shard %d of %d of %s (%d positions)", index + 1, shards, series, positions)

    return progress


def _progress(share: float, steps: int):
    every = max(1, steps // 20)

    def progress(step: int, loss: float, agreement: list[float]) -> None:
        if step % every == 0 or step == steps - 1:
            logger.info(
                "share %g step %d/%d: loss %.3f, agreement by depth %s",
                share,
                step + 1,
                steps,
                loss,
                [round(a, 3) for a in agreement],
            )

    return progress
