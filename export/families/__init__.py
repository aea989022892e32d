"""Architecture families: one small module each, registered by decorator.

A family turns a Hugging Face config and state dict into a `ModelSpec` and the canonical weights
of `paradecode.graphs.modules`, and names the model's final norm and LM head (which trained exit
heads reuse). Adding a family is one file here plus its tiny model in the tests.
"""

from paradecode.export.families import gemma3, gpt2, llama, mistral, phi3, qwen2, qwen3  # noqa: F401  (registration)
from paradecode.export.families.base import Family, family_for, register, registered_families

__all__ = ["Family", "family_for", "register", "registered_families"]
