"""Tiny random Hugging Face models of every supported family, built in-process from configs.

Each entry exercises the family's odd corners: grouped-query attention with an uneven ratio,
head_dim != hidden/heads, untied embeddings, rope scaling, q/k/v bias, q/k norm, sliding windows
shorter than the test sequences, GPT-2's learned positions and Conv1D weights, Gemma 3's interleaved
sliding and full layers with two rotary bases, Phi-3's fused projections and partial longrope rotary.
"""

from __future__ import annotations

import torch

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=89,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=2,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=83,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        model_type="mistral",
        vocab_size=79,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=5,
        tie_word_embeddings=False,
    ),
    # Sliding layers (a window of 5, shorter than the prompts) around a full one, their own rotary base, one key/value
    # head, head_dim independent of hidden / heads, query_pre_attn_scalar other than head_dim, soft-capped logits
    # (Gemma 2's value; Gemma 3's configs leave it unset) and linear rope scaling on the full layers.
    "gemma3": dict(
        model_type="gemma3_text",
        vocab_size=91,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=20,
        query_pre_attn_scalar=24,
        max_position_embeddings=128,
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        final_logit_softcapping=15.0,
        tie_word_embeddings=True,
    ),
    # Partial rotary embeddings (half of each head), longrope scaling (short factors up to 64 positions, the
    # attention factor of a 4x longer context), a sliding window of 7 over every layer, untied embeddings.
    "phi3": dict(
        model_type="phi3",
        vocab_size=87,
        hidden_size=48,
        intermediate_size=72,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        sliding_window=7,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.7],
            "long_factor": [2.5, 6.0],
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=101,
        n_embd=32,
        n_layer=3,
        n_head=4,
        n_positions=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    ),
}


# Held out from development: other shapes and options of every family, checked by
# tests/runtime/test_heldout_parity.py only.
HELDOUT_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        vocab_size=71,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=67,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=73,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=128,
        attention_bias=True,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    ),
    "mistral": dict(
        model_type="mistral",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=3,
        tie_word_embeddings=True,
    ),
    # head_dim 16, two key/value heads, no cap; a window of 6, shorter than the prompts, in a sliding layer between
    # two full ones (each with its rotary base).
    "gemma3": dict(
        model_type="gemma3_text",
        vocab_size=71,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        sliding_window=6,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    ),
    # Full rotary embeddings, default rope, no window, multi-head attention, tied embeddings.
    "phi3": dict(
        model_type="phi3",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=53,
        n_embd=24,
        n_layer=4,
        n_head=2,
        n_inner=100,
        n_positions=96,
        activation_function="gelu",
        scale_attn_weights=False,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    ),
}


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, configs: dict | None = None):
    """A tiny random causal LM of `family`, with weights scaled so its logits are not all near ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict((configs or TINY_CONFIGS)[family])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # the default init (std 0.02) gives near-uniform logits: spread them out
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3 if "emb" in name or "wte" in name or "wpe" in name else 0.15)
            elif "norm" in name or "ln_" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.05)
    return model.eval()


def tiny_gemma3_multimodal(seed: int = 0):
    """A `gemma3` checkpoint (Gemma3ForConditionalGeneration: the tiny gemma3 text model beside a one-layer vision
    tower), whose text part is what paradecode exports."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = {k: v for k, v in TINY_CONFIGS["gemma3"].items() if k != "model_type"}
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    special = dict(image_token_index=90, boi_token_index=88, eoi_token_index=89)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, **special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3 if "emb" in name else 0.15)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
    return model.eval()


def save_tiny_model(family: str, folder, seed: int = 0) -> None:
    tiny_model(family, seed).save_pretrained(folder)


def save_random_heads(model, path, seed: int = 0):
    """A heads file for `model` (a model folder or a GGUF file): random transforms near identity at every
    intermediate layer and a reduced vocabulary of two thirds of the token ids (so its graphs are like
    trained ones)."""
    from paradecode.export.heads.file import save_heads
    from paradecode.export.source import resolve_model

    source = resolve_model(str(model))
    config = source.config_dict()
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    hidden, vocab = config.get("hidden_size", config.get("n_embd")), config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    transforms = {
        e: torch.eye(hidden) + 0.05 * torch.randn(hidden, hidden, generator=generator) for e in range(1, layers)
    }
    ids = torch.sort(torch.randperm(vocab, generator=generator)[: max(2, 2 * vocab // 3)]).values
    identity = source.identity()
    metadata = {"base_model": str(model), "base_weights_sha256": identity["weights_sha256"]}
    return save_heads(path, transforms, metadata, vocab=ids)


def save_untrained_draft_head(model, path, seed: int = 0, features: bool = False):
    """An untrained draft head for `model` (a model folder or a GGUF file) over a reduced vocabulary of two thirds of
    the token ids (export/draft_head.py); `features`: one reading three layers' outputs."""
    from paradecode.export.draft_head import make_untrained_draft_head
    from paradecode.export.source import resolve_model

    vocab = resolve_model(str(model)).config_dict()["vocab_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.sort(torch.randperm(vocab, generator=generator)[: max(2, 2 * vocab // 3)]).values
    return make_untrained_draft_head(str(model), path, ids.tolist(), seed=seed, features=features)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (token ids), the reference every parity test compares with."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            # no padding: a prompt token equal to pad_token_id is not padding (else generate masks it and shifts
            # the positions after it)
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()
