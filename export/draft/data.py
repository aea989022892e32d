"""A draft head's data: sequences the model writes, and the last layer's outputs its export computes on them.

The draft head reads the last layer's outputs as decoding hands them over, which are the export's (its quantized
weights, its int8 activations), so they are recorded through the export itself: each sequence goes through its
graphs in one teacher-forced call per graph, which also gives the final head's top-1 at every position. A sequence is
a prompt and the model's answer, decoded in batches by this project's engine (plain decoding: greedy, or sampled
with a seed for more varied answers to the same prompt), or a window of a text, alone or teacher-forced as the reply
to a prompt (no answer: a corpus's text costs one forward pass a sequence, not a generation per token).

A folder of shards (`shard-00000.safetensors`, `text-00000.safetensors`, ...), each holding a run of sequences,
per position:

    tokens     [N] int64      the sequences' token ids, one after another
    hidden     [N, D] float16 the last layer's output there (what the final head reads)
    features   [N, 2, D] float16  the outputs of a low and a middle layer there (`feature_layers`: EAGLE-3's
                              fusion reads them beside the last layer's)
    target     [N] int64      the final head's top-1 there: the export's own choice of the next token
    answer     [N] bool       the next token is the model's greedy answer (where chains are measured)
    starts     [S + 1] int64  sequence s holds positions starts[s] .. starts[s + 1] - 1

Memory: recording holds one shard (about 3.5 KB a position on SmolLM2: three layers' outputs of D = 576 in float16);
training reads the folder whole (a million positions: about 3.5 GB). Resuming: jobs are fixed lists, one per series
of shards (`shard-*`: the model's answers; `text-*`: texts; `written-*`: answers to prompts it wrote), shard i of a
series is its jobs [i * size, (i + 1) * size), shards are written atomically in order with their series' jobs' and
the export's digests in their metadata, so a run finds the shards already made by the same export from the same jobs
and goes on after them, and adding a series leaves the others' shards valid.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from paradecode.export.draft_head import feature_layers
from paradecode.export.prompt_files import Prompt
from paradecode.graphs.errors import UserInputError

logger = logging.getLogger(__name__)

FORMAT = "paradecode-draft-data/2"
PER_POSITION = ("tokens", "hidden", "features", "target", "answer")
FIELDS = (*PER_POSITION, "starts")


@dataclass(frozen=True)
class Job:
    """One sequence to record: the model's answer to `prompt` (greedy at temperature 0, else sampled with `seed`),
    or `text` as it is (a window of a corpus), after `prompt` where both are given (teacher-forced as its reply)."""

    prompt: Prompt | None = None
    text: str | None = None
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class DraftData:
    """Shards' tensors, one after another (the module docstring says what each holds)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    features: torch.Tensor
    target: torch.Tensor
    answer: torch.Tensor
    starts: torch.Tensor

    @property
    def sequences(self) -> int:
        return len(self.starts) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def sequence(self, s: int) -> slice:
        return slice(int(self.starts[s]), int(self.starts[s + 1]))

    @classmethod
    def cat(cls, parts: list[DraftData]) -> DraftData:
        offsets = torch.tensor([0] + [len(p) for p in parts[:-1]]).cumsum(0)
        starts = torch.cat([parts[0].starts[:1]] + [p.starts[1:] + o for p, o in zip(parts, offsets, strict=True)])
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in PER_POSITION), starts)

    def select(self, sequences: list[int]) -> DraftData:
        """These sequences alone, in this order."""
        rows = [torch.arange(self.starts[s], self.starts[s + 1]) for s in sequences]
        lengths = torch.tensor([0] + [len(r) for r in rows])
        index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        fields = (getattr(self, f)[index] for f in PER_POSITION)
        return DraftData(*fields, lengths.cumsum(0))


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def jobs_digest(jobs: list[Job]) -> str:
    return digest([asdict(job) for job in jobs])


def teacher_forced(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, D] float16, features [T, 2, D] float16, target [T] int64): the last layer's outputs, those of
    `feature_layers`, and the final head's top-1 at every position of `ids`, as `model`'s export computes them (one
    call per graph over the whole sequence)."""
    from paradecode.runtime.decoding import MAIN, DecodeContext
    from paradecode.runtime.row_exactness import AS_IS
    from paradecode.runtime.tracing import Timeline

    backend = model.backend
    ctx = DecodeContext(backend, backend.allocate_cache(1), Timeline(record_spans=False), form=AS_IS)
    low, middle = feature_layers(ctx.num_layers)
    with ctx.prompt():
        first = ctx.layers(MAIN, 1, low, ctx.embed(MAIN, ids, 0), 0)
        second = ctx.layers(MAIN, low + 1, middle, first, 0) if middle > low else first
        hidden = ctx.layers(MAIN, middle + 1, ctx.num_layers, second, 0)
        target = ctx.head(MAIN, "final", hidden, 0).token
    features = torch.stack([first[0], second[0]], dim=1).to(torch.float16)
    return hidden[0].to(torch.float16), features, torch.tensor(target, dtype=torch.int64)


def sequences_of(model, jobs: list[Job], new_tokens: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of each job: a prompt with the model's answer (decoded in batches of the export's
    rows), a text's ids alone (prompt length = its length) or after its prompt's; cut to the export's capacity."""
    from paradecode.runtime.engine import generate_batched

    out: list[tuple[list[int], int] | None] = [None] * len(jobs)
    asked, requests = [], []
    for i, job in enumerate(jobs):
        prompt = dict(messages=job.prompt) if isinstance(job.prompt, list) else dict(prompt=job.prompt)
        if job.text is not None:
            if job.prompt is None:
                ids = model.prompt_ids(job.text)[: model.capacity]
                out[i] = (ids, len(ids))
            else:
                asked_ids = model.prompt_ids(**prompt)
                reply = model.tokenizer.encode(job.text, add_special_tokens=False)
                out[i] = ([*asked_ids, *reply][: model.capacity], len(asked_ids))
            continue
        sampled = dict(temperature=job.temperature, seed=job.seed) if job.temperature > 0 else {}
        requests.append(model.request(**prompt, mode="ar", max_new_tokens=new_tokens, **sampled))
        asked.append(i)
    for i, request, result in zip(asked, requests, generate_batched(model.runtime, requests), strict=True):
        out[i] = (list(request.ids) + list(result.token_ids), len(request.ids))
    return out


def record_shard(model, jobs: list[Job], new_tokens: int) -> DraftData:
    """The data of `jobs`' sequences (the module docstring)."""
    parts = []
    for job, (ids, prompt_length) in zip(jobs, sequences_of(model, jobs, new_tokens), strict=True):
        hidden, features, target = teacher_forced(model, ids)
        tokens = torch.tensor(ids, dtype=torch.int64)
        answer = torch.zeros(len(ids), dtype=torch.bool)
        if job.text is None and job.temperature == 0:
            answer[prompt_length - 1 : -1] = True  # the last prompt position chose the answer's first token
        parts.append(DraftData(tokens, hidden, features, target, answer, torch.tensor([0, len(ids)])))
    return DraftData.cat(parts)


# the series of shards: the model's answers, texts teacher-forced, answers to prompts it wrote (export/draft/written.py)
ANSWERS, TEXTS, WRITTEN = "shard", "text", "written"


def shard_path(folder: Path, index: int, series: str = ANSWERS) -> Path:
    return folder / f"{series}-{index:05d}.safetensors"


def record(
    model,
    jobs: list[Job],
    folder: Path,
    *,
    shard_size: int,
    new_tokens: int,
    series: str = ANSWERS,
    limit: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> list[Path]:
    """Record `jobs` into `folder`'s shards of `series` (the first `limit` alone, where given), going on after the
    ones a run with the same export and jobs left there; `progress(shard, shards, positions)` after each. The shards'
    paths."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    identity = {"format": FORMAT, "export": model.manifest.model["weights_sha256"], "jobs": jobs_digest(jobs)}
    identity |= {"shard_size": str(shard_size), "new_tokens": str(new_tokens)}
    shards = -(-len(jobs) // shard_size) if limit is None else min(limit, -(-len(jobs) // shard_size))
    paths = []
    for index in range(shards):
        path = shard_path(folder, index, series)
        paths.append(path)
        if path.exists():
            check_shard(path, identity)
            continue
        data = record_shard(model, jobs[index * shard_size : (index + 1) * shard_size], new_tokens)
        tmp = path.with_name(path.name + ".tmp")
        try:
            save_file({f: getattr(data, f).contiguous() for f in FIELDS}, str(tmp), metadata=identity)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        if progress is not None:
            progress(index, shards, len(data))
    return paths


def check_shard(path: Path, identity: dict[str, str]) -> None:
    """Refuse a shard that another export, other jobs or another version of this format made."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    differs = sorted(k for k, v in identity.items() if metadata.get(k) != v)
    if differs:
        raise UserInputError(
            f"{path} was recorded by another run (its {', '.join(differs)} differ from this one's): give another "
            f"--data folder, or empty {path.parent} to record it again."
        )


def load_data(paths: list[Path]) -> DraftData:
    """The shards' data, one after another."""
    from safetensors.torch import load_file

    parts = []
    for path in paths:
        tensors = load_file(str(path))
        missing = [f for f in FIELDS if f not in tensors]
        if missing:
            raise UserInputError(f"{path} is not a draft-data shard: it has no {', '.join(missing)}.")
        parts.append(DraftData(*(tensors[f] for f in FIELDS)))
    return DraftData.cat(parts)
