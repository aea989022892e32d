"""Exit heads: distillation on a tiny model, calibration, the heads file through export and the runtime."""

import json

import pytest
import torch

from paradecode.export.distill import CostModel, calibrate
from paradecode.runtime import load
from paradecode.tools import train_heads


@pytest.fixture(scope="module")
def trained(model_dirs, tmp_path_factory):
    """Heads for the tiny llama (4 layers) after layers 1 and 2, trained on its own greedy text."""
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    assert (
        train_heads.main(
            [
                str(model_dirs["llama"]),
                "--exit-layers",
                "1,2",
                "-o",
                str(out),
                "--steps",
                "150",
                "--new-tokens",
                "48",
                "--use-all-exits",
                "--target-agreement",
                "0.8",
            ]
        )
        == 0
    )
    from paradecode.export.heads import load_heads

    transforms, metadata = load_heads(out)
    return out, transforms, metadata


def test_training_raises_agreement_at_every_exit_layer(trained):
    _, transforms, metadata = trained
    assert sorted(transforms) == [1, 2] and transforms[1].shape == (48, 48)
    for layer, row in metadata["agreement"].items():
        print(f"layer {layer}: untrained {row['untrained']:.3f} -> trained {row['trained']:.3f}")
        assert row["trained"] > row["untrained"] + 0.1, (layer, row)
    assert not torch.allclose(transforms[1], torch.eye(48))


def test_training_reports_decreasing_loss(model_dirs, tmp_path):
    from paradecode.export.distill import collect, greedy_sequences, split_held_out
    from paradecode.export.distill import train_heads as train
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3")
    prompts = [[i, i + 1, i + 2] for i in range(0, 40, 4)]
    features = collect(model, greedy_sequences(model, prompts, 24), (1, 2))
    held_out = split_held_out(features, 0.2, seed=0)
    _, history = train(model, features, held_out, steps=100, lr=1e-2, batch=256, log_every=25)
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < 0.7 * losses[0], losses
    assert history[-1]["agreement_2"] > history[0]["agreement_2"], history


def test_heads_file_round_trips_through_export_and_runtime(trained, model_dirs, tmp_path):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.graphs.manifest import read_manifest

    heads, _, metadata = trained
    out = tmp_path / "export"
    result = export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, heads=heads, max_seq_len=64))
    assert not result.checklist.failed, result.checklist.lines()
    manifest = read_manifest(out)
    assert manifest.head_kind == "trained" and manifest.exit_layers == (1, 2)
    for layer in (1, 2):
        calibrated = metadata["calibration"]["thresholds"][str(layer)]
        assert manifest.thresholds[layer] == (calibrated if calibrated is not None else float("inf"))
    assert manifest.calibration["agreement"] == metadata["agreement"]
    import onnx

    graph = onnx.load(str(out / "onnx" / "exit_1.onnx"))
    assert sum(n.op_type == "MatMul" for n in graph.graph.node) == 2, "the exit head applies its transform"
    with load(out) as model:
        ar = model.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, mode="ar", ignore_eos=True)
        for overlap in ("batched", "both"):
            ours = model.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, overlap=overlap, ignore_eos=True)
            assert ours.token_ids == ar.token_ids
            forced = model.generate(
                prompt_ids=[5, 6, 7], max_new_tokens=30, overlap=overlap, thresholds=0.0, ignore_eos=True
            )
            assert forced.token_ids == ar.token_ids


def test_heads_cli_errors(model_dirs, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    assert train_heads.main([str(model_dirs["llama"]), "--exit-layers", "4", "-o", str(out)]) == 2
    assert "1..3" in capsys.readouterr().err
    out.write_text("keep")
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "keep"
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(tmp_path / "h"), "--prompts", "missing.txt"]) == 2
    assert "no tokenizer" in capsys.readouterr().err  # the tiny model has no tokenizer to read prompts with


def synthetic(n=2000, seed=0):
    """Layer 2: confident and right above 0.8, unreliable below; layer 3: always right above 0.3."""
    g = torch.Generator().manual_seed(seed)
    conf2 = torch.rand(n, generator=g)
    agree2 = torch.where(conf2 >= 0.8, torch.rand(n, generator=g) < 0.98, torch.rand(n, generator=g) < 0.4)
    conf3 = torch.rand(n, generator=g)
    agree3 = torch.where(conf3 >= 0.3, torch.ones(n, dtype=torch.bool), torch.rand(n, generator=g) < 0.5)
    return {2: conf2, 3: conf3}, {2: agree2, 3: agree3}


def test_calibration_finds_the_lowest_threshold_meeting_the_target():
    confidence, agree = synthetic()
    result = calibrate(confidence, agree, target=0.95)
    t2, t3 = result["thresholds"]["2"], result["thresholds"]["3"]
    assert 0.7 <= t2 <= 0.82 and 0.2 <= t3 <= 0.32, result["thresholds"]
    for layer in ("2", "3"):
        row = result["layers"][layer]
        assert row["precision"] >= 0.95
        kept = confidence[int(layer)] >= row["threshold"]
        assert float(agree[int(layer)][kept].float().mean()) >= 0.95
    never = calibrate({1: torch.rand(500)}, {1: torch.zeros(500, dtype=torch.bool)}, target=0.95)
    assert never["thresholds"] == {"1": None} and never["layers"]["1"]["exit_rate"] == 0.0


def test_cost_model_selects_the_subset_expected_to_be_fastest():
    confidence, agree = synthetic()
    cheap = calibrate(confidence, agree, 0.95, CostModel(num_layers=8, head=0.1))
    assert cheap["expected_speedup"] > 1 and cheap["subsets"][0]["layers"] == cheap["selected_layers"]
    speedups = [s["speedup"] for s in cheap["subsets"]]
    assert speedups == sorted(speedups, reverse=True)
    unused = [layer for layer in ("2", "3") if int(layer) not in cheap["selected_layers"]]
    assert all(cheap["thresholds"][layer] is None for layer in unused)
    hopeless = calibrate(confidence, agree, 0.95, CostModel(num_layers=4, head=5.0))
    assert hopeless["selected_layers"] == [] and all(v is None for v in hopeless["thresholds"].values())
    json.dumps(cheap)  # stored in the heads file's metadata


def test_heads_saved_beside_the_model_do_not_change_its_identity(trained, model_dirs, tmp_path):
    """A heads file written into the model's own folder is not one of the model's weight files."""
    import shutil

    from paradecode.export.source import resolve_model

    folder = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], folder)
    before = resolve_model(str(folder)).identity()["weights_sha256"]
    shutil.copy(trained[0], folder / "heads.safetensors")
    assert resolve_model(str(folder)).identity()["weights_sha256"] == before == trained[2]["base_weights_sha256"]
