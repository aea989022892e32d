"""A completion's text is what its tokens add to the prompt's: decode(prompt + output) minus decode(prompt).

That is the Hugging Face pipelines' and vLLM's convention; decoding the output alone drops the leading
space a SentencePiece tokenizer gives the first token ("Once upon a" + "time, ..." glued together).
Checked on a SentencePiece tokenizer (stories260K) and a byte-level BPE (the tiny chat export of the
server's tests, `served_export`), in the API, paradecode-generate and both endpoints, whole and streamed; the expected
text is computed here with the `tokenizers` library directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paradecode.runtime import cli, load
from paradecode.runtime.serve.config import ServeConfig
from tests.serving import Server, sse_events

pytestmark = pytest.mark.timeout(300)

NAME = "model"
NEW_TOKENS = 12
PROMPTS = ("Once upon a", "Once upon a time there was", "What is two plus two?")


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level"])
def text_export(request) -> tuple[str, Path]:
    """(tokenizer kind, export folder)."""
    if request.param == "sentencepiece":
        return request.param, request.getfixturevalue("stories_export")[0]
    return request.param, request.getfixturevalue("served_export")


@pytest.fixture(scope="module")
def model(text_export):
    with load(text_export[1]) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def server(text_export):
    running = Server(ServeConfig(text_export[1], served_model_name=NAME))
    yield running
    running.close()


def completion_of(export: Path, prompt_ids: list[int], ids: list[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(export / "tokenizer" / "tokenizer.json"))
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)
    whole, head = decode(prompt_ids + ids), decode(prompt_ids)
    assert whole.startswith(head)
    return whole[len(head) :]


def generated(model, prompt: str):
    return model.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_result_and_stream_text_is_the_prompts_continuation(text_export, model, prompt):
    kind, export = text_export
    result = generated(model, prompt)
    want = completion_of(export, model.prompt_ids(prompt), result.token_ids)
    assert result.text == want
    with model.stream(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True) as stream:
        pieces = [piece.text for piece in stream]
    assert "".join(pieces) == want and stream.result.text == want
    if kind == "sentencepiece" and prompt == "Once upon a":
        assert want.startswith(" time"), want  # the space the tokens decode to after the prompt


def test_streaming_decodes_a_few_tokens_per_step(stories_export, monkeypatch):
    """Constant work per token: each step decodes the tokens since the last piece and a few before them; only the
    result's text decodes the whole sequence, once, at the end."""
    with load(stories_export[0]) as model:
        sizes = []
        real = model.tokenizer.decode
        monkeypatch.setattr(model.tokenizer, "decode", lambda ids: sizes.append(len(ids)) or real(ids))
        prompt = model.prompt_ids("Once upon a time " * 8)
        with model.stream(prompt_ids=prompt, mode="ar", max_new_tokens=200, ignore_eos=True) as stream:
            text = "".join(piece.text for piece in stream)
        assert text == stream.result.text and stream.result.stats.new_tokens == 200
        assert max(sizes[:-2]) <= 12 and sorted(sizes)[-2:] == [len(prompt), len(prompt) + 200], sizes[-4:]


def test_a_stop_string_at_the_very_start_is_found(stories_export):
    with load(stories_export[0]) as model:
        assert generated(model, "Once upon a").text.startswith(" time")
        stopped = model.generate("Once upon a", mode="ar", max_new_tokens=NEW_TOKENS, stop=" time")
        assert stopped.stats.stop_reason == "stop_string" and stopped.stats.new_tokens == 1
        assert stopped.text == " time"


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_generate_cli_prints_the_continuation(text_export, model, prompt, capsys):
    export = text_export[1]
    want = generated(model, prompt).text
    argv = [str(export), "--prompt", prompt, "--mode", "ar", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == want + "\n"
    assert cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == want


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completions_whole_and_streamed(server, model, prompt):
    want = generated(model, prompt).text
    body = {"model": NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    whole = server.post("/v1/completions", body).json()
    assert whole["choices"][0]["text"] == want
    *chunks, done = sse_events(server.post("/v1/completions", {**body, "stream": True}).text.splitlines())
    assert done == "[DONE]" and "".join(c["choices"][0]["text"] for c in chunks) == want


def test_chat_whole_and_streamed(text_export, server, model):
    if text_export[0] != "byte-level":
        pytest.skip("stories260K has no chat template")
    messages = [{"role": "user", "content": "What is two plus two?"}]
    want = model.generate(messages=messages, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert want.text == completion_of(text_export[1], model.prompt_ids(messages=messages), want.token_ids)
    body = {"model": NAME, "messages": messages, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    assert server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"] == want.text
    events = sse_events(server.post("/v1/chat/completions", {**body, "stream": True}).text.splitlines())
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == want.text


def test_the_server_finds_a_stop_string_at_the_start(stories_export):
    running = Server(ServeConfig(stories_export[0], served_model_name=NAME))
    try:
        body = {"model": NAME, "prompt": "Once upon a", "max_tokens": NEW_TOKENS, "stop": " time", "ignore_eos": True}
        whole = running.post("/v1/completions", body).json()["choices"][0]
        assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == ("", "stop", " time")
        *chunks, done = sse_events(running.post("/v1/completions", {**body, "stream": True}).text.splitlines())
        assert "".join(c["choices"][0]["text"] for c in chunks) == "" and chunks[-1]["choices"][0]["stop_reason"]
        assert done == "[DONE]"
    finally:
        running.close()
