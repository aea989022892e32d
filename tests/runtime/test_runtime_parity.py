"""ParaDecode == ar == Hugging Face greedy, token for token, on every family and on stories260K.

Every combination the runtime offers: both CPU backends (torch, onnxruntime); overlaps streams,
batched and both; thresholds 0 (every token exits, and untrained heads make nearly every one roll
back: the stress test of pending layers and rollback), 0.5, and never; K = 1 and K = 8.
"""

import itertools

import pytest
import torch

from paradecode.runtime import NEVER, load
from tests.parity import assert_same_tokens, export_scorer, hf_scorer
from tests.tiny_models import TINY_CONFIGS, tiny_model

PROMPTS = [(5, 20), (11, 40)]  # (prompt length, new tokens); the exports hold 64 positions
SETTINGS = list(itertools.product((0.0, 0.5, NEVER), ("streams", "batched", "both"), (1, 8)))


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(family: str, length: int, new_tokens: int) -> tuple[list[int], list[int]]:
        key = (family, length, new_tokens)
        if key not in cache:
            model = tiny_model(family)
            prompt = prompt_of(length, model.config.vocab_size, seed=length)
            cache[key] = prompt, hf_greedy(model, prompt, new_tokens)
        return cache[key]

    return get


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_paradecode_equals_ar_equals_transformers(family, backend, exports, references):
    folder, _ = exports[family]
    with load(folder, backend=backend) as model:
        for length, new_tokens in PROMPTS:
            prompt, expected = references(family, length, new_tokens)
            ar = model.generate(prompt_ids=prompt, max_new_tokens=new_tokens, mode="ar", ignore_eos=True)
            what = f"{family}/{backend} ar vs transformers"
            assert_same_tokens(ar.token_ids, expected, what, prompt=prompt, score=hf_scorer(tiny_model(family)))
            for threshold, overlap, k in SETTINGS:
                result = model.generate(
                    prompt_ids=prompt,
                    max_new_tokens=new_tokens,
                    mode="paradecode",
                    thresholds=threshold,
                    overlap=overlap,
                    max_unverified=k,
                    ignore_eos=True,
                )
                what = f"{family}/{backend} paradecode threshold={threshold} overlap={overlap} K={k} vs ar"
                assert_same_tokens(result.token_ids, ar.token_ids, what, prompt=prompt, score=export_scorer(model))
                stats = result.stats
                if threshold == NEVER:
                    assert not stats.exits_per_layer and stats.rollbacks == 0, what
                if threshold == 0.0:
                    # with K = 1 every other token can exit: the next must run to the final layer
                    assert sum(stats.exits_per_layer.values()) >= (new_tokens - 1) // 2, (
                        f"{what}: too few exits {stats}"
                    )
                    assert stats.rollbacks + sum(stats.accepted_per_layer.values()) > 0, what


def test_rollback_stress_really_rolls_back(exports):
    """Untrained heads at threshold 0: most early tokens are wrong, so rollbacks must happen (and parity hold)."""
    folder, _ = exports["llama"]
    with load(folder) as model:
        result = model.generate(
            prompt_ids=[3, 1, 4, 1, 5],
            max_new_tokens=40,
            thresholds=0.0,
            overlap="both",
            max_unverified=8,
            ignore_eos=True,
        )
        ar = model.generate(prompt_ids=[3, 1, 4, 1, 5], max_new_tokens=40, mode="ar", ignore_eos=True)
    assert result.token_ids == ar.token_ids
    assert result.stats.rollbacks >= 10, result.stats
    first = result.stats.mismatches[0]
    assert first.early_token != first.final_token and first.final_margin >= 0


def test_stories260k_paradecode_reproduces_the_published_greedy_text(stories_dir, tmp_path_factory, capsys):
    """`paradecode-generate EXPORT --prompt-ids 1 --mode paradecode` prints the published greedy text."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.runtime import cli

    out = tmp_path_factory.mktemp("stories-runtime") / "export"
    export_model(ExportConfig(model=str(stories_dir / "hf"), output=out))
    golden = (stories_dir / "golden_greedy_from_bos.txt").read_text().rstrip("\n")  # 565 characters + newline
    assert len(golden) == 565
    for overlap in ("batched", "streams", "both"):
        assert (
            cli.main(
                [str(out), "--prompt-ids", "1", "--mode", "paradecode", "--overlap", overlap, "--max-new-tokens", "260"]
            )
            == 0
        )
        printed = capsys.readouterr().out
        assert printed.startswith(golden), f"{overlap}: {printed[:120]!r}"

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(stories_dir / "hf")).eval()
    with load(out) as model:
        for text in ("Once upon a time, there was a dog", "The little bird", "Tom and Sue went to the park. They"):
            prompt = model.tokenizer.encode(text)
            expected = hf_greedy(hf, prompt, 48)
            for backend_model in (model,):
                ar = backend_model.generate(prompt_ids=prompt, max_new_tokens=48, mode="ar", ignore_eos=True)
                score = hf_scorer(hf)
                assert_same_tokens(ar.token_ids, expected, f"stories ar {text!r}", prompt=prompt, score=score)
                for threshold, overlap, k in SETTINGS:
                    result = backend_model.generate(
                        prompt_ids=prompt,
                        max_new_tokens=48,
                        thresholds=threshold,
                        overlap=overlap,
                        max_unverified=k,
                        ignore_eos=True,
                    )
                    what = f"stories paradecode {text!r} {threshold}/{overlap}/K={k}"
                    assert_same_tokens(result.token_ids, expected, what, prompt=prompt, score=score)


def test_fused_exit_layers_are_used_and_optional(model_dirs, exports, tmp_path):
    """With layer_exit_e graphs the frontier's exit check costs no extra call; without them, separate heads run."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    fused, _ = exports["qwen3"]
    plain = tmp_path / "plain"
    heads = fused.parent / "heads.safetensors"  # the same trained heads, without the fused graphs
    export_model(ExportConfig(model=str(model_dirs["qwen3"]), output=plain, heads=heads, max_seq_len=64))
    prompt = [9, 8, 7, 6]
    names = {}
    for label, folder in (("fused", fused), ("plain", plain)):
        with load(folder) as model:
            ar = model.generate(prompt_ids=prompt, max_new_tokens=30, mode="ar", ignore_eos=True)
            for overlap in ("batched", "streams", "both"):
                result = model.generate(
                    prompt_ids=prompt, max_new_tokens=30, thresholds=0.5, overlap=overlap, ignore_eos=True, trace=True
                )
                assert result.token_ids == ar.token_ids, (label, overlap)
                names[label] = {s.name for s in result.timeline.spans}
    assert any(n.startswith("layer_exit_") for n in names["fused"])
    assert not any(n.startswith("exit_") for n in names["fused"])
    assert any(n.startswith("exit_") for n in names["plain"])
    assert not any(n.startswith("layer_exit_") for n in names["plain"])
