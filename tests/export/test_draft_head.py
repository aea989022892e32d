"""The draft head's graph (export/draft_head.py, graphs/modules.py `DraftGraph`): exported for every family, run by
both CPU backends, refused where it does not fit the model.

Every family's `exports` fixture carries an untrained draft head over two thirds of the vocabulary. What its graph
must do, whatever its weights: compute each position from the positions before it alone (its cache, written in
place, as a layer's), so T positions in one call equal T calls of one; and read its guess with the model's own final
norm and unembedding rows, so its token is the final head's top-1 over the draft's vocabulary on its `hidden_out`.
"""

from __future__ import annotations

import json

import pytest
import torch

from paradecode.export.draft_head import (
    FORMAT,
    FUSE,
    VOCAB,
    check_draft_head,
    feature_layers,
    load_draft_head,
    save_draft_head,
    untrained_draft_head,
)
from paradecode.export.heads.file import load_heads
from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.graphs.manifest import MANIFEST_NAME, Manifest, read_manifest
from paradecode.graphs.tensors import (
    EMBEDDED,
    HIDDEN,
    HIDDEN_OUT,
    LOGITS,
    MARGIN,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    TOKEN,
)

BACKENDS = ("onnxruntime", "torch")
START, TOKENS = 3, 5  # the positions 3..7


def draft_feeds(backend, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random features and embeddings at positions START.., a fresh cache of the export's slots."""
    spec = backend.spec
    cache = (1, spec.num_kv_heads, backend.manifest.max_seq_len, spec.head_dim)  # one layer's, as every layer's
    shape = (1, TOKENS, spec.hidden_size)
    return {
        HIDDEN: torch.randn(shape, generator=generator),
        EMBEDDED: torch.randn(shape, generator=generator),
        POSITIONS: torch.arange(START, START + TOKENS)[None],
        PAST_KEY: torch.zeros(cache),
        PAST_VALUE: torch.zeros(cache),
    }


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_draft_graph_computes_a_position_from_the_ones_before_it_and_reads_it_with_the_final_head(
    family, backend_name, exports, loaded
):
    folder, _ = exports[family]
    backend = loaded[family, backend_name].backend
    vocab = load_draft_head(folder.parent / "draft.safetensors")[0][VOCAB]
    feeds = draft_feeds(backend, torch.Generator().manual_seed(0))
    together = backend.run("draft", {k: v.clone() for k, v in feeds.items()})
    assert together[HIDDEN_OUT].shape == feeds[HIDDEN].shape and together[TOKEN].shape == (1, TOKENS)
    # one position a call, over one cache: the same outputs (a position reads only the slots at or before it)
    key, value = feeds[PAST_KEY].clone(), feeds[PAST_VALUE].clone()
    for t in range(TOKENS):
        one = {HIDDEN: feeds[HIDDEN][:, t : t + 1], EMBEDDED: feeds[EMBEDDED][:, t : t + 1]}
        one |= {POSITIONS: feeds[POSITIONS][:, t : t + 1], PAST_KEY: key, PAST_VALUE: value}
        alone = backend.run("draft", one)
        torch.testing.assert_close(alone[HIDDEN_OUT][0, 0], together[HIDDEN_OUT][0, t], rtol=1e-4, atol=1e-5)
        assert alone[TOKEN][0, 0] == together[TOKEN][0, t]
    # its cache written in place at its positions only, as one call or one at a time
    written = key.abs().sum(dim=(0, 1, 3)) > 0
    assert written.nonzero().flatten().tolist() == list(range(START, START + TOKENS))
    # its guess is the final head's top-1 over the draft's vocabulary on its own output
    logits = backend.run("final", {HIDDEN: together[HIDDEN_OUT]}, outputs=(LOGITS,))[LOGITS][0]
    restricted = logits[:, vocab]
    margin = restricted.topk(2, dim=-1).values
    assert vocab[restricted.argmax(-1)].tolist() == together[TOKEN][0].tolist()
    torch.testing.assert_close(together[MARGIN][0], margin[:, 0] - margin[:, 1], rtol=1e-4, atol=1e-4)


def test_both_backends_compute_the_same_draft(exports, loaded):
    feeds = draft_feeds(loaded["qwen3", "torch"].backend, torch.Generator().manual_seed(1))
    outs = [loaded["qwen3", b].backend.run("draft", {k: v.clone() for k, v in feeds.items()}) for b in BACKENDS]
    torch.testing.assert_close(outs[0][HIDDEN_OUT], outs[1][HIDDEN_OUT], rtol=1e-4, atol=1e-5)
    assert outs[0][TOKEN].tolist() == outs[1][TOKEN].tolist()


def test_the_manifest_names_the_draft_head_and_refuses_one_that_does_not_fit(exports):
    folder, result = exports["llama"]
    manifest = read_manifest(folder)
    assert manifest.draft == result.manifest.draft
    assert manifest.subgraphs[-1].io.name == "draft"
    assert any(line.lstrip().startswith("[  ok]  draft") for line in result.checklist.lines())
    data = json.loads((folder / MANIFEST_NAME).read_text())
    without = dict(data, draft=None)  # a draft graph the settings do not call for
    with pytest.raises(ManifestError, match=r"unexpected \['draft'\]"):
        Manifest.from_dict(without)
    missing = dict(data, subgraphs=data["subgraphs"][:-1])
    with pytest.raises(ManifestError, match=r"missing \['draft'\]"):
        Manifest.from_dict(missing)
    too_large = dict(data, draft=dict(data["draft"], vocab=manifest.spec.vocab_size + 1))
    with pytest.raises(ManifestError, match="draft.vocab is .*expected at most the model's vocabulary"):
        Manifest.from_dict(too_large)
    with pytest.raises(ManifestError, match="draft.trained is 'no'; expected true or false"):
        Manifest.from_dict(dict(data, draft=dict(data["draft"], trained="no")))


def test_a_head_reading_three_layers_has_its_map_graph_and_its_layers_in_the_manifest(exports):
    """Gemma 3's export (tests/conftest.py DRAFT_FEATURE_FAMILIES): a `draft_reduce` graph after the draft graph, its
    feature layers in the manifest, refused where they and the graphs do not agree or name no layer before the last."""
    folder, result = exports["gemma3"]
    manifest = read_manifest(folder)
    layers = manifest.spec.num_layers
    assert manifest.feature_layers == feature_layers(layers) == tuple(result.manifest.draft["feature_layers"])
    assert [s.io.name for s in manifest.subgraphs[-2:]] == ["draft", "draft_reduce"]
    assert any(line.lstrip().startswith("[  ok]  draft_reduce") for line in result.checklist.lines())
    data = json.loads((folder / MANIFEST_NAME).read_text())
    single = dict(data["draft"])
    del single["feature_layers"]
    with pytest.raises(ManifestError, match=r"unexpected \['draft_reduce'\]"):
        Manifest.from_dict(dict(data, draft=single))
    for bad in ([1], [0, 1], [1, layers], ["1", 2]):
        with pytest.raises(
            ManifestError, match=rf"draft.feature_layers is .*expected the two layers \(each in 1\.\.{layers - 1}\)"
        ):
            Manifest.from_dict(dict(data, draft=dict(data["draft"], feature_layers=bad)))


def test_a_draft_head_for_another_model_or_of_other_shapes_is_refused(tmp_path, exports, model_dirs):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    folder, _ = exports["llama"]
    manifest = read_manifest(folder)
    spec, model = manifest.spec, manifest.model
    good = load_draft_head(folder.parent / "draft.safetensors")
    mine = {"base_model": "llama", "base_weights_sha256": model["weights_sha256"], "trained": False}

    def refused(tensors, metadata, match):
        path = save_draft_head(tmp_path / "draft.safetensors", tensors, metadata)
        loaded_tensors, loaded_metadata = load_draft_head(path)
        with pytest.raises(UserInputError, match=match):
            check_draft_head(path, loaded_tensors, loaded_metadata, spec=spec, model=model)

    check_draft_head(folder.parent / "draft.safetensors", *good, spec=spec, model=model)  # the fixture's fits
    other = read_manifest(exports["qwen2"][0]).model
    refused(good[0], dict(mine, base_weights_sha256=other["weights_sha256"]), "was made for another model")
    narrow = dict(good[0], **{FUSE: good[0][FUSE][:, :-2]})
    refused(narrow, mine, r"draft.fuse.weight is torch.float32 \[.*\], expected a float tensor .* other shapes")
    layer_less = {k: v for k, v in good[0].items() if not k.startswith("draft.layer.mlp.")}
    refused(layer_less, mine, r"missing \['draft.layer.mlp")
    refused(dict(good[0], **{VOCAB: torch.tensor([0, spec.vocab_size])}), mine, "outside 0..")
    refused(dict(good[0], **{VOCAB: torch.tensor([4, 4, 5])}), mine, "more than once")
    refused(dict(good[0], **{VOCAB: torch.tensor([4])}), mine, "at least 2 int64 token ids")
    # the file itself: another kind of file, none at all; and through the export, which writes nothing
    with pytest.raises(UserInputError, match="not a paradecode draft-head file"):
        load_draft_head(exports["llama"][0].parent / "heads.safetensors")
    with pytest.raises(UserInputError, match="no such file.*make_untrained_draft_head"):
        load_draft_head(tmp_path / "absent.safetensors")
    with pytest.raises(UserInputError, match="--heads .* is not a paradecode heads file .*'paradecode-draft/1'"):
        load_heads(folder.parent / "draft.safetensors")  # the other way round: one reader, two formats
    from safetensors.torch import save_file

    save_file({FUSE: torch.zeros(1)}, str(tmp_path / "odd.safetensors"), metadata={"format": FORMAT, "metadata": "{"})
    with pytest.raises(UserInputError, match="its metadata is not JSON"):
        load_draft_head(tmp_path / "odd.safetensors")
    other_head = exports["qwen2"][0].parent / "draft.safetensors"
    out = tmp_path / "export"
    with pytest.raises(UserInputError, match="was made for another model"):
        export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, draft_head=other_head, max_seq_len=32))
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))


def test_an_untrained_head_is_seeded_and_shaped_as_the_models_last_layer(exports):
    spec = read_manifest(exports["gemma3"][0]).spec
    first, again = untrained_draft_head(spec, range(10), seed=3), untrained_draft_head(spec, range(10), seed=3)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert first[FUSE].shape == (spec.hidden_size, 2 * spec.hidden_size)
    assert first["draft.layer.post_attn_norm.weight"].shape == (spec.hidden_size,)  # Gemma's sandwich norms
    assert not torch.equal(first[FUSE], untrained_draft_head(spec, range(10), seed=4)[FUSE])
