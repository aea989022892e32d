"""Exit heads (paradecode.export.heads): recording during batched generation, the reduced vocabulary and its
budget, distillation, the heads file through export and the runtime, the speed calibration against hand-computed
and exhaustive references, and the command line (the call costs and the cost model: test_call_costs.py and
test_cost_model.py)."""

import dataclasses
import itertools
import json
import math
import os
import time
from collections import Counter

import pytest
import torch

from paradecode.export.families import family_for
from paradecode.export.heads import cli as train_heads
from paradecode.export.heads.calibration import GRID, calibrate, expected_speedup
from paradecode.export.heads.cost_model import CostModel
from paradecode.export.heads.data import generate_features, held_out_sequences, text_features
from paradecode.export.heads.file import check_heads, load_heads
from paradecode.export.heads.pipeline import HeadsConfig
from paradecode.export.heads.training import (
    Unembedding,
    evaluate_heads,
    least_squares_init,
    restricted_kl,
    teacher_log_probs,
)
from paradecode.export.heads.training import train_heads as train
from paradecode.export.heads.vocab import frequent_tokens, head_parameters, layer_parameters, vocab_budget
from paradecode.graphs.errors import UserInputError
from paradecode.runtime import load
from tests.tiny_models import tiny_model

TINY_LAYER = 48 * (2 * 72 + 2 * 24) + 3 * 48 * 80  # q/k/v/o and the gated MLP of the tiny llama: 20,736


def spec_of(family: str):
    model = tiny_model(family)
    return model, family_for(family).spec(model.config, model)


def recorded(family: str, prompts, new_tokens: int, exit_layers, held=None, batch: int = 4, eos=None):
    """The tiny model's recording; it stops at `eos` only (None: never)."""
    model, spec = spec_of(family)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    held = torch.zeros(len(prompts), dtype=torch.bool) if held is None else held
    recording = generate_features(
        model, family_for(family), spec, prompts, exit_layers, held, new_tokens=new_tokens, batch=batch
    )
    return model, spec, recording


# --- recording during generation ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])  # gemma3: soft-capped logits, sliding windows
def test_recording_during_batched_generation_equals_a_second_forward_pass(family):
    """Left-padded batches of uneven prompts: every generated token's features are what an unpadded forward pass
    over the finished sequence computes at the position that predicted it (float16 storage: 1e-2 relative)."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [16, 17, 18], [19]]
    model, _spec, recording = recorded(family, prompts, 12, (1, 2), batch=3)
    features = recording.features
    assert len(features) == 12 * len(prompts) and features.final.dtype == torch.float16
    worst = 0.0
    for index, (prompt, sequence) in enumerate(zip(prompts, recording.sequences)):
        assert sequence[: len(prompt)] == prompt and len(sequence) == len(prompt) + 12
        rows = features.sequence == index
        with torch.no_grad():
            out = model(torch.tensor([sequence]), output_hidden_states=True)
        span = slice(len(prompt) - 1, len(sequence) - 1)  # the positions that predicted the continuation
        logits = out.logits[0, span]
        assert torch.equal(features.token[rows], logits.argmax(-1)), index
        assert torch.equal(features.token[rows], torch.tensor(sequence[len(prompt) :])), "greedy tokens"
        torch.testing.assert_close(features.lognorm[rows], torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-4)
        for layer in (1, 2):
            reference = out.hidden_states[layer][0, span]
            got = features.exits[layer][rows].float()
            worst = max(worst, float(((got - reference).abs() / reference.abs().max()).max()))
        final = out.hidden_states[-1][0, span]
        worst = max(worst, float(((features.final[rows].float() - final).abs() / final.abs().max()).max()))
    print(f"{family}: largest difference relative to the tensor's largest value {worst:.2e}")
    assert worst < 1e-2


def test_recording_stops_at_eos_and_counts_only_training_sequences():
    """Tokens after a row's EOS are padding: no features, no soft counts; held-out sequences add no soft counts."""
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    _, _, free = recorded("llama", prompts, 10, (2,))
    first = free.sequences[0][3:]
    eos = first[4]  # the fifth token of the first continuation ends it (and maybe others)
    held = torch.tensor([False, True, False, False])
    model, _spec, recording = recorded("llama", prompts, 10, (2,), held=held, eos=eos)
    for index, prompt in enumerate(prompts):
        continuation = free.sequences[index][len(prompt) :]
        expected = continuation[: continuation.index(eos) + 1] if eos in continuation else continuation
        assert recording.sequences[index] == prompt + expected, index
        assert int((recording.features.sequence == index).sum()) == len(expected)
    assert torch.equal(recording.held_out, recording.features.sequence == 1)
    with torch.no_grad():  # the soft counts: the final distribution summed over the training positions
        logits = Unembedding.of(model, family_for("llama")).final_logits(
            recording.features.final[~recording.held_out].float()
        )
    expected = torch.softmax(logits, -1).sum(0).double()
    torch.testing.assert_close(recording.soft_counts, expected, atol=2e-2, rtol=1e-3)
    assert abs(float(recording.soft_counts.sum()) - int((~recording.held_out).sum())) < 1e-3


def test_text_features_keep_every_position():
    model, spec = spec_of("qwen3")
    windows = [[1, 2, 3, 4, 5], [6, 7, 8]]
    recording = text_features(model, family_for("qwen3"), spec, windows, (1,), torch.tensor([False, True]))
    assert len(recording.features) == 8 and recording.held_out.tolist() == [False] * 5 + [True] * 3
    with torch.no_grad():
        logits = model(torch.tensor([windows[0]])).logits[0]
    assert torch.equal(recording.features.token[:5], logits.argmax(-1))


def test_held_out_sequences():
    mask = held_out_sequences(10, 0.2, seed=0)
    assert int(mask.sum()) == 2 and torch.equal(mask, held_out_sequences(10, 0.2, seed=0))
    assert int(held_out_sequences(2, 0.9, seed=0).sum()) == 1  # one left to train on
    assert int(held_out_sequences(3, 0.01, seed=0).sum()) == 1  # at least one held out


# --- the reduced vocabulary --------------------------------------------------------------------------------


def test_reduced_vocabulary_is_the_final_layers_most_frequent_predictions():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 9, 7])
    soft = torch.zeros(12, dtype=torch.float64)
    soft[[3, 11, 0]] = torch.tensor([0.5, 0.9, 0.5], dtype=torch.float64)
    soft[7] = 5.0  # soft counts never outrank a token the final layer chose more often
    assert frequent_tokens(tokens, soft, 4).tolist() == [5, 2, 9, 7]  # ties (2 x 2) broken by the lower id
    assert frequent_tokens(tokens, soft, 7).tolist() == [5, 2, 9, 7, 11, 0, 3]  # then by soft counts, then id
    assert frequent_tokens(tokens, soft, 12).sort().values.tolist() == list(range(12))


def test_recorded_vocabulary_ranks_the_training_predictions():
    prompts = [[i, i + 1, i + 2] for i in range(3, 60, 5)]
    held = held_out_sequences(len(prompts), 0.25, seed=1)
    _, _spec, recording = recorded("llama", prompts, 16, (2,), held=held)
    train_tokens = recording.features.token[~recording.held_out]
    vocab = frequent_tokens(train_tokens, recording.soft_counts, 30)
    counts = Counter(train_tokens.tolist())
    ranked = sorted(counts, key=lambda t: (-counts[t], -float(recording.soft_counts[t]), t))
    assert vocab.tolist()[: min(30, len(ranked))] == ranked[:30]
    assert len(vocab) == 30


def test_vocabulary_budget_is_one_decoder_layer():
    _, spec = spec_of("llama")
    assert layer_parameters(spec) == TINY_LAYER
    assert vocab_budget(spec, 1.0) == 97  # room for more than the whole vocabulary
    size = vocab_budget(spec, 0.2)  # 0.2 x 20,736 = 4,147 parameters: 48 x 48 for T, then 38 rows of 48
    assert size == 38 and head_parameters(spec, size) <= 0.2 * TINY_LAYER < head_parameters(spec, size + 1)
    with pytest.raises(UserInputError, match=r"--head-budget 0.1 layers .* leaves room for 0 tokens"):
        vocab_budget(spec, 0.1)
    smollm2 = dataclasses.replace(
        spec, vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536,
    )  # fmt: skip
    assert layer_parameters(smollm2) == 3_538_944
    assert vocab_budget(smollm2, 1.0) == 5568  # 5568 x 576 + 576^2 = 3,538,944: exactly one layer
    assert head_parameters(smollm2, 5568) <= layer_parameters(smollm2) < head_parameters(smollm2, 5569)


# --- distillation ------------------------------------------------------------------------------------------


def test_restricted_kl_by_hand():
    teacher = torch.log(torch.tensor([[0.5, 0.3]]))  # 0.2 of the teacher's mass lies outside the head's vocabulary
    student = torch.log(torch.tensor([[0.75, 0.25]]))
    cross_entropy = -(0.5 * math.log(0.75) + 0.3 * math.log(0.25))
    minimum = -(0.5 * math.log(0.5 / 0.8) + 0.3 * math.log(0.3 / 0.8))  # at q = p / m
    assert float(restricted_kl(student, teacher)) == pytest.approx(cross_entropy - minimum)
    assert float(restricted_kl(torch.log(torch.tensor([[0.625, 0.375]])), teacher)) == pytest.approx(0, abs=1e-7)


def test_training_lowers_the_loss_raises_agreement_and_leaves_the_model_unchanged():
    family = "qwen3"
    prompts = [[i, i + 1, i + 2] for i in range(0, 80, 4)]
    held = held_out_sequences(len(prompts), 0.2, seed=0)
    model, _spec, recording = recorded(family, prompts, 24, (1, 2), held=held)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    features = recording.features
    vocab = frequent_tokens(features.token[~recording.held_out], recording.soft_counts, 40)
    unembedding = Unembedding.of(model, family_for(family))
    transforms, history = train(
        unembedding, features, recording.held_out, vocab, steps=120, lr=1e-2, batch=256, log_every=30
    )
    losses = [h["loss"] for h in history if "loss" in h]
    print(f"loss {losses}, agreement at layer 2 {[h['agreement_2'] for h in history]}")
    assert losses[-1] < 0.8 * losses[0], losses
    rows = torch.nonzero(recording.held_out).squeeze(1)
    _, untrained = evaluate_heads(unembedding, features, rows, dict.fromkeys((1, 2)), vocab)
    confidence, trained = evaluate_heads(unembedding, features, rows, transforms, vocab)
    for e in (1, 2):
        print(f"layer {e}: agreement {untrained[e].float().mean():.3f} -> {trained[e].float().mean():.3f}")
        assert trained[e].float().mean() > untrained[e].float().mean() + 0.1
        assert confidence[e].max() <= 1 and confidence[e].min() >= 1 / len(vocab)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"training heads changed the model's own weights: {changed}"


def test_least_squares_start_undoes_gemmas_norm_scale_of_one_plus_weight():
    """Gemma 3's final norm multiplies by 1 + weight (its family's `final_norm_scale`), and its logits are capped: the
    least-squares start fitted with that scale has a lower loss than the model's own head and than a start fitted with
    the norm's raw weight. (The tiny model's own head agrees with the final layer unusually often, its embedding
    dominating the residual stream, so agreement is not what is compared.)"""
    import dataclasses

    prompts = [[i, i + 1] for i in range(0, 90, 3)]
    held = held_out_sequences(len(prompts), 0.2, seed=0)
    model, _, recording = recorded("gemma3", prompts, 20, (1, 2), held=held)
    features, rows = recording.features, torch.nonzero(~recording.held_out).squeeze(1)
    unembedding = Unembedding.of(model, family_for("gemma3"))
    assert unembedding.softcap == 15.0
    assert torch.equal(unembedding.norm_scale, 1.0 + model.model.norm.weight.detach())
    raw = dataclasses.replace(unembedding, norm_scale=model.model.norm.weight.detach())
    teacher = teacher_log_probs(unembedding, features, rows, None)

    def loss(start, e):
        with torch.no_grad():
            student = torch.log_softmax(unembedding.head_logits(features.exits[e][rows].float(), start), -1)
            return float(restricted_kl(student, teacher))

    fitted, misfitted = least_squares_init(unembedding, features, rows), least_squares_init(raw, features, rows)
    for e in (1, 2):
        own, right, wrong = loss(None, e), loss(fitted[e], e), loss(misfitted[e], e)
        print(f"layer {e}: own head {own:.4f}, fitted with 1 + weight {right:.4f}, with the weight {wrong:.4f}")
        assert right < min(own, wrong)


def test_least_squares_start_fits_the_final_hidden_state():
    """The start maps h_e onto the final hidden state (before the norm's scale): the head then agrees more often
    than the model's own head there, and the loss is lower than from identity."""
    family = "llama"
    prompts = [[i, i + 1] for i in range(0, 90, 3)]
    held = held_out_sequences(len(prompts), 0.2, seed=0)
    model, _, recording = recorded(family, prompts, 20, (1, 2), held=held)
    features, rows = recording.features, torch.nonzero(~recording.held_out).squeeze(1)
    unembedding = Unembedding.of(model, family_for(family))
    init = least_squares_init(unembedding, features, rows)
    assert all(t.norm() == pytest.approx(48**0.5, rel=1e-4) for t in init.values())
    test = torch.nonzero(recording.held_out).squeeze(1)
    teacher = teacher_log_probs(unembedding, features, rows, None)
    for e in (1, 2):
        _, own = evaluate_heads(unembedding, features, test, {e: None}, None)
        _, fitted = evaluate_heads(unembedding, features, test, {e: init[e]}, None)
        print(f"layer {e}: own head {own[e].float().mean():.3f}, least squares {fitted[e].float().mean():.3f}")
        assert fitted[e].float().mean() > own[e].float().mean()

        def loss(t, e=e):
            student = torch.log_softmax(unembedding.head_logits(features.exits[e][rows].float(), t), -1)
            return float(restricted_kl(student, teacher).detach())

        assert loss(init[e]) < loss(None)


# --- the heads file through the command line, export and runtime -----------------------------------------------


@pytest.fixture(scope="module")
def trained(model_dirs, tmp_path_factory):
    """Heads for the tiny llama (4 layers) after layers 1, 2 and 3 over a 38-token vocabulary (a 0.2-layer
    budget), trained on its own greedy text, calibrated with call costs measured here."""
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    args = [str(model_dirs["llama"]), "--exit-layers", "1,2,3", "-o", str(out), "--steps", "60", "--lr", "1e-2"]
    assert train_heads.main([*args, "--new-tokens", "48", "--head-budget", "0.2", "--max-prompts", "20"]) == 0
    transforms, metadata, vocab = load_heads(out)
    return out, transforms, metadata, vocab


@pytest.mark.slow
def test_heads_file_carries_the_reduced_vocabulary_and_the_report(trained):
    _, transforms, metadata, vocab = trained
    assert sorted(transforms) == [1, 2, 3] and transforms[1].shape == (48, 48)
    assert metadata["data"]["sequences"] == 20 and metadata["data"]["prompts_available"] == 24  # --max-prompts
    assert vocab.dtype == torch.int64 and len(vocab) == 38 == metadata["vocab"]["size"]
    assert len(set(vocab.tolist())) == 38 and int(vocab.min()) >= 0 and int(vocab.max()) < 97
    assert metadata["vocab"]["head_parameters"] <= 0.2 * TINY_LAYER
    coverage = metadata["vocab"]["held_out_coverage"]
    for layer, row in metadata["agreement"].items():
        print(f"layer {layer}: untrained {row['untrained']:.3f} -> trained {row['trained']:.3f} (coverage {coverage})")
        assert row["trained"] <= coverage, "a head agrees only where the final token is in its vocabulary"
        if layer != "3":  # the last layer's own head already agrees about as often as 38 tokens allow
            assert row["trained"] > row["untrained"] + 0.1, (layer, row)
    calibration = metadata["calibration"]
    costs = calibration["call_costs"]
    assert costs["exit_head_vocab"] == 38 and set(costs["layer_ms"]) == {"1", "2", "4"}
    assert calibration["cost_model"]["source"] == "measured"
    assert set(calibration["thresholds"]) == {"1", "2", "3"}
    chosen = {int(e) for e, t in calibration["thresholds"].items() if t is not None}
    assert chosen == set(calibration["selected_layers"])
    assert calibration["check"]["positions"] > 0 and calibration["expected_speedup"] >= 1.0
    json.dumps(metadata)


@pytest.mark.slow
def test_heads_file_round_trips_through_export_and_runtime(trained, model_dirs, tmp_path):
    import onnx

    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.graphs.manifest import read_manifest

    heads, _, metadata, _ = trained
    out = tmp_path / "export"
    result = export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, heads=heads, max_seq_len=64))
    assert not result.checklist.failed, result.checklist.lines()
    manifest = read_manifest(out)
    assert manifest.head_kind == "trained" and manifest.exit_layers == (1, 2, 3) and manifest.head_vocab == 38
    for layer in (1, 2, 3):
        calibrated = metadata["calibration"]["thresholds"][str(layer)]
        assert manifest.thresholds[layer] == (calibrated if calibrated is not None else float("inf"))
    assert manifest.calibration["agreement"] == metadata["agreement"]
    graph = onnx.load(str(out / "onnx" / "exit_1.onnx"), load_external_data=False)
    shapes = {tuple(i.dims) for i in graph.graph.initializer}
    assert (38, 48) in shapes or (48, 38) in shapes, f"no reduced unembedding among {shapes}"
    with load(out) as model:
        ar = model.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, mode="ar", ignore_eos=True)
        for overlap in ("batched", "both"):
            ours = model.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, overlap=overlap, ignore_eos=True)
            assert ours.token_ids == ar.token_ids
            forced = model.generate(
                prompt_ids=[5, 6, 7], max_new_tokens=30, overlap=overlap, thresholds=0.0, ignore_eos=True
            )
            assert forced.token_ids == ar.token_ids
            exits = forced.stats.exits_per_layer
            assert sum(exits.values()) > 0 and set(exits) <= {1, 2, 3}, exits  # the reduced heads fired


@pytest.fixture(scope="module")
def trained_export(trained, model_dirs, tmp_path_factory):
    """The tiny llama exported with the `trained` heads (their 38-token vocabulary)."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path_factory.mktemp("costs") / "export"
    export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, heads=trained[0], max_seq_len=64))
    return out


@pytest.mark.slow
def test_heads_calibrated_on_an_exports_own_costs(trained_export, model_dirs, tmp_path):
    """--costs FOLDER: the thresholds are chosen with the call costs of that export's graphs, timed here; -o
    into a folder that does not exist yet makes it."""
    out = tmp_path / "new" / "heads.safetensors"
    args = ["--exit-layers", "1,2,3", "--steps", "5", "--new-tokens", "16", "--max-prompts", "8"]
    args += ["--head-budget", "0.2"]
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(out), *args, "--costs", str(trained_export)]) == 0
    calibration = load_heads(out)[1]["calibration"]
    assert calibration["costs"] == {"export": "export", "dtype": "float32", "activations": None, "ops": "fused"}
    measured = calibration["call_costs"]
    assert measured["backend"].startswith("onnxruntime CPU") and measured["exit_head_vocab"] == 38
    assert sorted(measured["layer_ms"]) == ["1", "2", "4"] and calibration["cost_model"]["source"] == "measured"


@pytest.mark.slow
def test_heads_refuse_an_export_whose_costs_are_not_theirs(trained_export, model_dirs, tmp_path, capsys, monkeypatch):
    from paradecode.export.config import ExportConfig
    from paradecode.export.heads import pipeline
    from paradecode.export.pipeline import export_model

    plain = tmp_path / "plain"
    export_model(ExportConfig(model=str(model_dirs["llama"]), output=plain, max_seq_len=64, segments=False))
    (tmp_path / "file").write_text("not an export")

    def generates(*args):
        raise AssertionError("the model generated before the refusal")

    monkeypatch.setattr(pipeline, "record", generates)
    model, out = str(model_dirs["llama"]), str(tmp_path / "h")
    budget = ["--head-budget", "0.2"]
    refusals = [
        ([model, *budget, "--costs", str(tmp_path)], "is not a paradecode export: it has no manifest.json"),
        ([model, *budget, "--costs", str(tmp_path / "file")], "the one holding manifest.json) whose graphs are timed"),
        ([model, *budget, "--costs", ""], "timed here; an empty path is no such folder"),
        ([model, "--costs", str(trained_export)], "the export's exit heads read 38 tokens, these heads "),
        ([str(model_dirs["qwen2"]), "--costs", str(trained_export)], "the export is of another model"),
        ([model, *budget, "--costs", str(plain)], "the export has no exit-head graphs (it was exported without"),
    ]
    for args, message in refusals:
        assert train_heads.main([*args, "-o", out]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "h").exists()


def test_heads_of_another_vocabulary_size_are_told_the_budget_of_the_exports(trained_export):
    """The refusal names the --head-budget that gives the export's vocabulary size, and that budget does."""
    from paradecode.export.heads.call_costs import check_costs_export
    from paradecode.graphs.manifest import read_manifest

    _, spec = spec_of("llama")
    identity = {"weights_sha256": read_manifest(trained_export).model["weights_sha256"], "source": "tiny"}
    with pytest.raises(UserInputError, match="--head-budget ([0-9.]+)") as refused:
        check_costs_export(trained_export, identity, spec, 40)
    budget = float(str(refused.value).split("--head-budget ")[1].split(",")[0])
    assert vocab_budget(spec, budget) == 38
    assert check_costs_export(trained_export, identity, spec, 38)["dtype"] == "float32"


@pytest.mark.slow
def test_heads_of_another_model_or_shape_are_refused(trained, model_dirs):
    from paradecode.export.source import resolve_model

    path, transforms, metadata, _ = trained
    _llama, spec = spec_of("llama")
    other = resolve_model(str(model_dirs["qwen2"])).identity()
    with pytest.raises(UserInputError, match="trained for another model"):
        check_heads(path, transforms, metadata, spec=spec, model=other, exit_layers=None)
    own = resolve_model(str(model_dirs["llama"])).identity()
    assert check_heads(path, transforms, metadata, spec=spec, model=own, exit_layers=None) == (1, 2, 3)
    with pytest.raises(UserInputError, match=r"layers \[4\], but .* heads for layers \[1, 2, 3\]"):
        check_heads(path, transforms, metadata, spec=spec, model=own, exit_layers=(1, 3, 4))
    with pytest.raises(UserInputError, match=r"shape \(32, 32\), expected \(48, 48\)"):
        check_heads(path, {1: torch.eye(32)}, metadata, spec=spec, model=own, exit_layers=None)


@pytest.mark.slow
def test_heads_saved_beside_the_model_do_not_change_its_identity(trained, model_dirs, tmp_path):
    """A heads file written into the model's own folder is not one of the model's weight files."""
    import shutil

    from paradecode.export.source import resolve_model

    folder = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], folder)
    before = resolve_model(str(folder)).identity()["weights_sha256"]
    shutil.copy(trained[0], folder / "heads.safetensors")
    assert resolve_model(str(folder)).identity()["weights_sha256"] == before == trained[2]["base_weights_sha256"]


def test_heads_from_text_windows(stories_dir, tmp_path):
    """--text: windows of given text, every position of each, through one forward pass; costs from parameters."""
    text = tmp_path / "story.txt"
    text.write_text(" ".join(["Once upon a time there was a little dog. He liked to play in the park."] * 12))
    out = tmp_path / "heads.safetensors"
    args = ["--text", str(text), "--window", "32", "--steps", "20", "--costs", "parameters", "--exit-layers", "2,3"]
    assert train_heads.main([str(stories_dir / "hf"), "-o", str(out), *args]) == 0
    transforms, metadata, vocab = load_heads(out)
    assert sorted(transforms) == [2, 3] and metadata["data"]["kind"] == "text"
    windows, positions = metadata["data"]["windows"], metadata["data"]["positions"]
    assert windows >= 4 and 32 * (windows - 1) + 2 <= positions <= 32 * windows  # every position of every window
    assert metadata["calibration"]["cost_model"]["source"] == "parameters" and vocab is not None


def test_heads_cli_errors(model_dirs, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    model = str(model_dirs["llama"])
    assert train_heads.main([model, "--exit-layers", "4", "-o", str(out), "--costs", "parameters"]) == 2
    assert "1..3" in capsys.readouterr().err
    out.write_text("keep")
    assert train_heads.main([model, "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "keep"
    assert train_heads.main([model, "-o", str(tmp_path / "h"), "--prompts", "missing.txt"]) == 2
    assert "no tokenizer" in capsys.readouterr().err  # the tiny model has no tokenizer to read prompts with
    assert train_heads.main([model, "-o", str(tmp_path / "h"), "--head-budget", "0.05"]) == 2
    assert "--head-budget 0.05 layers (1,037 parameters) leaves room for 0 tokens" in capsys.readouterr().err
    assert train_heads.main([model, "-o", str(tmp_path / "h"), "--held-out", "1.5"]) == 2
    assert "--held-out must be a share in (0, 1), got 1.5" in capsys.readouterr().err
    assert train_heads.main([model, "-o", str(tmp_path / "h"), "--costs", "guessed"]) == 2
    assert "--costs guessed: expected measured or parameters, or an export folder" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
    assert f"(default {HeadsConfig.default('steps')})" in train_heads.build_parser().format_help()


SEEDS = "an integer from -9223372036854775808 to 18446744073709551615 (-2**63 to 2**64 - 1, the seeds paradecode-serve"


@pytest.mark.timeout(60)  # refused before the model loads: the regression loaded for 23 s, then failed in torch
@pytest.mark.parametrize("seed", [str(2**64), str(2**80), str(-(2**63) - 1), "1e3"])
def test_heads_refuse_a_seed_generate_refuses_before_any_work(model_dirs, tmp_path, capsys, seed):
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        train_heads.main([str(model_dirs["llama"]), "-o", str(tmp_path / "h"), f"--seed={seed}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --seed: expected {SEEDS}" in err and seed in err and "Traceback" not in err, err
    assert time.monotonic() - started < 10 and not (tmp_path / "h").exists()


@pytest.mark.parametrize(("seed", "expected"), [("-1", 2**64 - 1), (str(2**64 - 1), 2**64 - 1), ("7", 7)])
def test_heads_take_the_seeds_generate_takes(seed, expected, tmp_path):
    """The edges of the range: the held-out split and the check split (the seed's successor) both take them."""
    args = train_heads.build_parser().parse_args(["m", "-o", str(tmp_path / "h"), f"--seed={seed}"])
    assert args.seed == expected and HeadsConfig(model="m", output=tmp_path / "h", seed=args.seed).seed == expected
    from paradecode.export.heads.pipeline import split_check

    sequence = torch.arange(8).repeat_interleave(2)
    calibration, check = split_check(torch.ones(16, dtype=torch.bool), sequence, expected)
    assert len(calibration) + len(check) == 16 and len(check) > 0


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_heads_config_refuses_a_seed_torch_cannot_take(seed, tmp_path):
    with pytest.raises(UserInputError, match=r"seed must be an integer from 0 to 18446744073709551615"):
        HeadsConfig(model="m", output=tmp_path / "h", seed=seed)


@pytest.mark.timeout(60)  # refused before the model loads: a regression would train first
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: ["-o", str(tmp)], "is a folder; give a file name"),
        (lambda tmp: ["-o", str(tmp), "--force"], "is a folder; give a file name"),
        (lambda tmp: ["-o", "/sys/heads.safetensors"], "cannot be written: /sys refuses new files"),
        (lambda tmp: ["-o", str(tmp / "f.txt" / "heads.safetensors")], "f.txt is not a folder"),
        (lambda tmp: ["-o", str(tmp / "fifo"), "--force"], "fifo is not a regular file"),  # /dev/null, safely
        (lambda tmp: ["-o", str(tmp / "h"), "--text", str(tmp / "binary.bin")], "is not UTF-8 text"),
        (lambda tmp: ["-o", str(tmp / "h"), "--text", str(tmp)], "is a folder; expected a text file"),
    ],
    ids=["folder", "folder-force", "unwritable", "under-a-file", "device-force", "binary-text", "text-folder"],
)
def test_heads_refuse_what_would_lose_the_results_before_training(model_dirs, tmp_path, capsys, make, message):
    (tmp_path / "f.txt").write_text("a file")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    model = str(model_dirs["llama"])  # built on first use, beside tmp_path: before the listing
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    started = time.monotonic()
    assert train_heads.main([model, *make(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert time.monotonic() - started < 10
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before, "a stray file (DIR.tmp?) was left"
    assert not (tmp_path / "h").exists()


@pytest.mark.timeout(120)
def test_heads_that_cannot_be_written_after_training_are_an_error_without_a_traceback(
    model_dirs, tmp_path, capsys, monkeypatch
):
    """-o's folder is missing when training starts (the writer makes it) and a file takes its name during the run:
    the write fails at the end, said in one line, exit code 1, nothing left half-written."""
    from paradecode.export.heads import file

    out = tmp_path / "heads" / "heads.safetensors"
    save_heads = file.save_heads

    def take_the_folder_then_save(*args, **kwargs):
        out.parent.write_text("took the folder's name during training")
        return save_heads(*args, **kwargs)

    monkeypatch.setattr(file, "save_heads", take_the_folder_then_save)
    args = ["--exit-layers", "1,2", "--steps", "2", "--new-tokens", "8", "--max-prompts", "2", "--costs", "parameters"]
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(out), *args]) == 1
    err = capsys.readouterr().err
    assert f"paradecode-train-heads: error: -o {out} could not be written after training (" in err, err
    assert "the heads are lost" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"] and out.parent.is_file()


def test_saving_heads_leaves_no_temporary_file_when_it_fails(tmp_path):
    from paradecode.export.heads.file import save_heads

    with pytest.raises(IsADirectoryError):
        save_heads(tmp_path, {1: torch.eye(2)}, {})  # a folder: the rename fails
    assert not (tmp_path.parent / f"{tmp_path.name}.tmp").exists()


# --- the speed calibration ------------------------------------------------------------------------------------


def test_calibration_picks_no_layer_when_heads_are_useless():
    g = torch.Generator().manual_seed(0)
    confidence = {2: torch.rand(2000, generator=g), 5: torch.rand(2000, generator=g)}
    wrong = {e: torch.zeros(2000, dtype=torch.bool) for e in confidence}  # confident or not, never right
    cost = CostModel(num_layers=8, head=0.1, merge=0.05, final=1.0, final_merge=0.1)
    result = calibrate(confidence, wrong, cost)
    assert result["selected_layers"] == [] and all(t is None for t in result["thresholds"].values())
    assert result["expected_speedup"] == 1.0 and result["best_found"]["speedup"] <= 1.0
    right = {e: torch.ones(2000, dtype=torch.bool) for e in confidence}
    costly = CostModel(num_layers=8, head=20.0, merge=0.05, final=1.0)  # right, but a head costs 20 layers
    assert calibrate(confidence, right, costly)["selected_layers"] == []


def test_calibration_picks_a_cheap_accurate_layer_and_its_lowest_safe_threshold():
    """Layer 2 of 8: right wherever its confidence is at least 0.5, wrong below. Exiting there saves
    6 x (1 - merge) layers and most of the final head; a wrong exit loses a whole token. So the threshold is
    the grid's lowest value at or above 0.5, and the expected speedup is the hand-computed one."""
    n = 4000
    confidence = {2: torch.arange(n) / n}  # uniform on [0, 1)
    agree = {2: confidence[2] >= 0.5}
    cost = CostModel(num_layers=8, head=0.2, merge=0.1, final=2.0, final_merge=0.2, other=0.1)
    result = calibrate(confidence, agree, cost)
    assert result["selected_layers"] == [2] and result["thresholds"] == {"2": 0.5}
    exit_cost = 2 + 0.2 + 0.1 * 6 + 0.2 + 0.1  # 3.1 layer calls
    through = 8 + 0.2 + 2.0 + 0.1  # 10.3
    expected = (8 + 2.0 + 0.1) / (0.5 * exit_cost + 0.5 * through)  # 10.1 / 6.7
    assert result["expected_speedup"] == pytest.approx(expected, abs=1e-4)
    assert result["expected_exits"] == {"exit_rate": 0.5, "accepted_rate": 0.5}
    row = result["layers"]["2"]
    assert row["exit_rate"] == pytest.approx(0.5) and row["precision"] == 1.0 and row["cascade_exit_rate"] == 0.5
    assert expected_speedup(cost, confidence, agree, result["thresholds"]) == pytest.approx(expected, abs=1e-9)
    assert expected_speedup(cost, confidence, agree, {"2": None}) == 1.0


def cascade_data(exit_layers, num_layers, positions, seed):
    """Heads whose confidence grows with depth and falls with a per-position difficulty shared by all
    layers (an easy token is easy everywhere), and whose agreement grows with confidence."""
    g = torch.Generator().manual_seed(seed)
    difficulty = torch.rand(positions, generator=g)
    confidence, agree = {}, {}
    for e in exit_layers:
        confidence[e] = torch.sigmoid(8 * (e / num_layers - difficulty) + torch.randn(positions, generator=g))
        agree[e] = torch.rand(positions, generator=g) < confidence[e] ** 0.3
    return confidence, agree


def exhaustive(cost, confidence, agree, grid):
    """The reference: every choice of a grid threshold or none per layer, the fastest if it beats plain decoding."""
    layers = sorted(confidence)
    best, best_speedup = {}, 1.0
    for choice in itertools.product([None, *grid], repeat=len(layers)):
        used = {e: t for e, t in zip(layers, choice) if t is not None}
        if not used or any(int((confidence[e] >= t).sum()) < 20 for e, t in used.items()):
            continue
        speedup = cost.ar() / cost.paradecode(tuple(used), confidence, agree, used)
        if speedup > best_speedup + 1e-9:
            best, best_speedup = used, speedup
    return best, best_speedup


def test_speed_calibration_matches_the_exhaustive_search_on_small_cases():
    """2 and 3 exit layers, a 5-value grid: every one of the 6^3 choices against the search and its refinement."""
    grid = (0.3, 0.5, 0.7, 0.85, 0.95)
    worse, proper = [], 0
    for count in (2, 3):
        for seed in range(6):
            num_layers = count + 3 + seed % 3
            layers = sorted(torch.randperm(num_layers - 1, generator=torch.Generator().manual_seed(seed))[:count])
            layers = [int(e) + 1 for e in layers]
            confidence, agree = cascade_data(layers, num_layers, 1500, seed)
            cost = CostModel(num_layers, head=(0.05, 0.3, 1.0)[seed % 3], merge=(0.0, 0.1, 0.3)[seed % 3], final=2.0)
            expected, expected_speedup = exhaustive(cost, confidence, agree, grid)
            result = calibrate(confidence, agree, cost, grid)
            proper += 0 < len(expected) < count
            # the report rounds to 4 decimals
            assert result["expected_speedup"] <= expected_speedup + 1e-4, "better than every choice: a bookkeeping bug"
            if result["expected_speedup"] < expected_speedup - 1e-4:
                found = result["expected_speedup"]
                worse.append((count, seed, result["thresholds"], expected, found, expected_speedup))
    assert not worse, f"(exit layers, seed, found, exhaustive, its speedup, exhaustive's): {worse}"
    assert proper >= 3, f"only {proper} cases select a proper subset: the comparison would prove little"


@pytest.mark.slow
def test_speed_calibration_scales_to_thirty_exit_layers():
    """(|GRID| + 1)^30 choices would take forever; the search is polynomial (this timer only guards that)."""
    confidence, agree = cascade_data(range(1, 31), num_layers=32, positions=3000, seed=0)
    cost = CostModel(num_layers=32, head=0.02, merge=0.0, final=1.0)
    start = time.perf_counter()
    result = calibrate(confidence, agree, cost)
    elapsed = time.perf_counter() - start
    assert elapsed < 30.0, f"calibrating 30 exit layers took {elapsed:.2f} s"
    selected = result["selected_layers"]
    assert len(selected) >= 3, selected  # at this head cost several layers pay: the search went deep
    assert len(result["subsets"]) == 8 and result["best_found"]["speedup"] >= result["subsets"][0]["speedup"]
    thresholds = {int(e): t for e, t in result["thresholds"].items() if t is not None}
    assert set(thresholds) == set(selected) and all(t in GRID for t in thresholds.values())

    def speedup(used):
        return cost.ar() / cost.paradecode(tuple(used), confidence, agree, used)

    assert result["expected_speedup"] == pytest.approx(speedup(thresholds), abs=1e-4)
    for subset in result["subsets"]:  # the search's own bookkeeping agrees with the cost model, set by set
        used = dict(zip(subset["layers"], subset["thresholds"]))
        assert subset["speedup"] == pytest.approx(speedup(used), abs=1e-4), subset
    for e in selected:  # no single change of one layer's threshold helps (the refinement's fixed point)
        for t in GRID:
            if int((confidence[e] >= t).sum()) >= 20:
                assert speedup({**thresholds, e: t}) <= speedup(thresholds) + 1e-9, (e, t)


def test_cascade_rates_follow_the_runtime():
    """A position exits at the first selected layer whose threshold it reaches, and only there."""
    confidence, agree = cascade_data([2, 4, 6], num_layers=8, positions=2000, seed=3)
    result = calibrate(confidence, agree, CostModel(num_layers=8, head=0.1, final=1.0))
    remaining = torch.ones(2000, dtype=torch.bool)
    for e in (2, 4, 6):
        row, threshold = result["layers"][str(e)], result["thresholds"][str(e)]
        exits = remaining & (confidence[e] >= threshold) if threshold is not None else torch.zeros_like(remaining)
        assert row["cascade_exit_rate"] == pytest.approx(float(exits.float().mean()), abs=1e-4), e
        assert row["selected"] == (threshold is not None)
        remaining &= ~exits
    assert sum(result["layers"][str(e)]["cascade_exit_rate"] for e in (2, 4, 6)) > 0.3, result["layers"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["gemma3-folder", "phi3-folder", "gemma3-gguf", "phi3-gguf"])
def test_heads_train_on_the_newer_families_from_either_source_and_decode_as_ar(source, model_dirs, tmp_path):
    """paradecode-train-heads on a Gemma 3 and a Phi-3 (a model folder and a GGUF file of each), then an export
    with those heads: ParaDecode with every token exiting at the trained heads gives plain decoding's tokens."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from tests.tiny_gguf import write_tiny_gguf

    family, kind = source.split("-")
    model = model_dirs[family] if kind == "folder" else tmp_path / f"{family}.gguf"
    if kind == "gguf":
        write_tiny_gguf(model, family=family)
    heads = tmp_path / "heads.safetensors"
    args = ["--exit-layers", "1,2", "--new-tokens", "12", "--steps", "5", "--max-prompts", "8", "--costs", "parameters"]
    assert train_heads.main([str(model), "-o", str(heads), *args]) == 0
    export_model(ExportConfig(model=str(model), output=tmp_path / "export", heads=heads, max_seq_len=64))
    with load(tmp_path / "export") as loaded:
        assert loaded.manifest.head_kind == "trained" and loaded.manifest.exit_layers == (1, 2)
        prompt = [5, 9, 3, 7, 11, 4, 8]
        ar = loaded.generate(prompt_ids=prompt, max_new_tokens=24, mode="ar", ignore_eos=True)
        result = loaded.generate(prompt_ids=prompt, max_new_tokens=24, thresholds=0.0, ignore_eos=True)
    assert result.token_ids == ar.token_ids and sum(result.stats.exits_per_layer.values()) > 0
