"""Fixtures of the server's tests (test_serve, test_serve_limits, test_completion_text): the export they serve and
`serve`, a server per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serving import SEQ_LEN, Server, config_of


@pytest.fixture(scope="session")
def served_export(tmp_path_factory) -> Path:
    """A tiny random Llama whose export carries a byte-level BPE tokenizer and a Llama 3 style chat template
    (max_seq_len SEQ_LEN). Tests only read it; one that changes it copies it first."""
    return chat_export(tmp_path_factory, seed=0)


@pytest.fixture(scope="session")
def reweighted_export(tmp_path_factory) -> Path:
    """`served_export`'s architecture, tokenizer and settings with other random weights (what re-exporting a
    fine-tuned model writes): its weights file has the same size, and only it and the manifest differ."""
    return chat_export(tmp_path_factory, seed=1)


def chat_export(tmp_path_factory, seed: int) -> Path:
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from tests.runtime.test_chat import CHAT_MODEL_TOKENS, LLAMA3, LLAMA3_SPECIALS, bpe_tokenizer, save_tokenizer
    from tests.tiny_models import TINY_CONFIGS, tiny_model

    model_dir = tmp_path_factory.mktemp("serve-model")
    tok = bpe_tokenizer(LLAMA3_SPECIALS, "<|begin_of_text|>")
    save_tokenizer(model_dir, tok, LLAMA3, **CHAT_MODEL_TOKENS)
    config = dict(
        TINY_CONFIGS["llama"],
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<|begin_of_text|>"),
        eos_token_id=tok.token_to_id("<|eot_id|>"),
    )
    tiny_model("llama", seed, configs={"llama": config}).save_pretrained(model_dir)
    out = tmp_path_factory.mktemp("serve-export") / "export"
    export_model(ExportConfig(model=str(model_dir), output=out, max_seq_len=SEQ_LEN))
    return out


@pytest.fixture
def serve():
    """serve(export, **ServeConfig fields) -> a Server of its own, closed after the test."""
    servers = []

    def start(export: Path, **fields) -> Server:
        servers.append(Server(config_of(export, **fields)))
        return servers[-1]

    yield start
    for running in servers:
        running.close()
