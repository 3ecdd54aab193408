"""(hf_name, torch.Tensor) pairs from a GGUF file, as vLLM's GGUF loader consumes them."""

import sys
from collections.abc import Iterator

import torch

import aiogguf

# llama.cpp's names -> Hugging Face's (llama); q/k keep llama.cpp's rotary row order.
HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
      "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
      "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}  # fmt: skip


def hf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")  # blk.0.attn_q + weight
    _, layer, part = base.split(".", 2) if base.startswith("blk.") else ("", "", base)
    return f"model.layers.{layer}.{HF[part]}.{kind}" if layer else f"{HF[base]}.{kind}"


def gguf_weights(path: str, **load_options: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, shared with torch (no copy); a quantized one as vLLM takes it:
    ``qweight`` (uint8 rows) after ``qweight_type`` (its ggml type id)."""
    with aiogguf.load_sync(path, **load_options) as model:
        for entry in model.index.tensors:
            name, tensor = hf_name(entry.name), model.torch(entry.name)
            if entry.type.is_quantized:
                yield name.replace("weight", "qweight_type"), torch.tensor(entry.type.id)
                name = name.replace("weight", "qweight")
            yield name, tensor


if __name__ == "__main__":
    for name, tensor in gguf_weights(sys.argv[1]):
        print(f"{name:48} {tensor.dtype!s:16} {tuple(tensor.shape)}")
