"""The toy family to / from transformers' LlamaForCausalLM: Llama's mapping, with w13 split into
gate_proj (w1) and up_proj (w3) on the way out and fused again on the way in."""

import torch

from torchllm.models.llama.hf import LlamaAdapter

from toy_family.model import ToyTransformer


class ToyAdapter(LlamaAdapter):
    model_cls = ToyTransformer
    # PEFT names one HF module per adapter; w13's adapter would span gate_proj and up_proj.
    peft_block = None
    peft_refusal = "its fused w13 is two Hugging Face modules"

    @classmethod
    def to_hf(cls, sd, args, vocab_size):
        sd = dict(sd)
        for i in range(args.n_layers):
            w13 = sd.pop(f"layers.{i}.feed_forward.w13.weight")
            sd[f"layers.{i}.feed_forward.w1.weight"], sd[f"layers.{i}.feed_forward.w3.weight"] = (
                w13.chunk(2))
        return super().to_hf(sd, args, vocab_size)

    @classmethod
    def from_hf(cls, hf_sd, args):
        sd = super().from_hf(hf_sd, args)
        for i in range(args.n_layers):
            ff = f"layers.{i}.feed_forward."
            sd[ff + "w13.weight"] = torch.cat([sd.pop(ff + "w1.weight"), sd.pop(ff + "w3.weight")])
        return sd
