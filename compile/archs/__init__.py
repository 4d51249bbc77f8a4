"""Architecture registry: Hugging Face `architectures[0]` → graph emitter class.

Qwen2 (q/k/v bias) and Mistral (sliding window) differ from Llama only in values that `ModelSpec`
carries, so they share the Llama emitter; an architecture whose graph differs gets its own subclass here.
"""

from .base import LlamaArch

REGISTRY: dict[str, type[LlamaArch]] = {
    "LlamaForCausalLM": LlamaArch,
    "MistralForCausalLM": LlamaArch,
    "Qwen2ForCausalLM": LlamaArch,
}
