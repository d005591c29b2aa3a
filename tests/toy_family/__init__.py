"""A model family from outside torchllm: one folder, registered by one line (below).

The tests import it through the config (`job.custom_import = "toy_family"`, with tests/ on
PYTHONPATH): docs/howto_model_family.md walks through the same steps. The family is Llama with
one change, the MLP: gate and up projections fused into one matrix (`w13`), so its weights
still map onto transformers' LlamaForCausalLM (the adapter splits and re-fuses them).
"""

from torchllm.models import register
from torchllm.models.kv_cache import KVCache
from torchllm.models.llama.plan import PIPELINE
from torchllm.models.spec import ModelSpec

from toy_family.args import flavors
from toy_family.config import ToyConfig
from toy_family.hf import ToyAdapter
from toy_family.model import ToyTransformer

SPEC = ModelSpec(
    name="toy_llama", model_cls=ToyTransformer, flavors=flavors,
    config=ToyConfig,  # its own [model] keys: Llama's shape keys and its new mlp_ratio
    cache_cls=KVCache, hf_adapter=ToyAdapter,
    tp_plan=None,  # a fused w13 cannot be split by columns naively: no tensor parallelism
    pipeline=PIPELINE,  # Llama's module names: the same stage split
    lora_targets=("wq", "wk", "wv", "wo", "w13", "w2"),
)

register(SPEC)
