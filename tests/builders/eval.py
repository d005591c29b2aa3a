"""Shared test builders (tests/builders/eval.py): imported by the test modules that use them."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchllm import models
from torchllm.checkpoint.index import dcp_writer
from torchllm.checkpoint.integrity import folder_checksums
from torchllm.checkpoint.layout import mark_complete
from torchllm.config import to_toml
from torchllm.data import build_tokenizer
from torchllm.data.sources.embedded import embedded_documents
from torchllm.data.tokenizer import SentencePieceTokenizer
from torchllm.data.tokenizer_training import train_sentencepiece
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer

from conftest import build_model, shared_path
from conftest import tiny_config


TINY_EXAMPLES = [
    {"ind": 0, "activity_label": "Cooking", "ctx": "A man cracks two eggs into a bowl. He",
     "endings": ["whisks them with a fork.", "throws the bowl at the moon.",
                 "paints the eggs blue and green.", "reads a newspaper upside down."], "label": 0},
    {"ind": 1, "activity_label": "Running", "ctx": "The runner ties her shoes and",
     "endings": ["starts to jog down the road.", "eats them.", "swims.", "sings to a cat."],
     "label": 0},
    {"ind": 2, "activity_label": "Python", "ctx": "The function returns a value that",
     "endings": ["is printed.", "the caller can use in an expression later on.", "x", "is."],
     "label": 1},
    {"ind": 3, "activity_label": "Weather", "ctx": "It starts to rain, so they",
     "endings": ["open their umbrellas.", "light a fire in the lake.", "fly.", "go."],
     "label": 0},
    {"ind": 4, "activity_label": "Music", "ctx": "She sits at the piano and",
     "endings": ["plays a quiet song.", "eats the keys one by one while the audience cheers.",
                 "becomes a piano.", "a"], "label": 0},
]


def write_tiny_jsonl(path, examples=TINY_EXAMPLES):
    path.write_text("".join(json.dumps(ex) + "\n" for ex in examples))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("hs_tok") / "sp512.model"
    return SentencePieceTokenizer(train_sentencepiece(embedded_documents(), 512, out))


def tiny_model(max_seq_len=160, seed=0):
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                     max_seq_len=max_seq_len)
    model = build_model(Transformer, args, seed)
    with torch.no_grad():  # a larger output scale spreads the scores (fewer near-ties)
        model.output.weight.mul_(8)
    return model.eval()


def whole_string_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Independent reference for how the model sees a pair (lm-eval's rule): the context's
    trailing whitespace goes to the continuation, the whole string is encoded once, and the
    continuation is what follows the context's own encoding (which must be a prefix of it)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, bos=True)
    ctx = tokenizer.encode(context, bos=True)
    assert whole[: len(ctx)] == ctx, (context, continuation)
    return ctx, whole[len(ctx):]


def write_run(tmp_path, complete_steps=(1, 2), incomplete_steps=(3,)):
    """A run folder as the trainer and checkpointer lay it out; returns (run_dir, {step: state})."""
    cfg = tiny_config(tmp_path, "--job.run_name=run", "--model.max_seq_len=128")
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    tokenizer = build_tokenizer(cfg.data, run_dir / "data")
    with torch.device("meta"):
        model = models.get("llama3").build(models.model_args(cfg.model, cfg.training, cfg.data,
                                                             tokenizer.vocab_size))
    model.to_empty(device="cpu")
    states = {}
    for step in complete_steps:
        torch.manual_seed(step)
        model.init_weights()
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        step_dir = run_dir / "checkpoint" / f"step-{step}"
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model.state_dict()}, storage_writer=dcp_writer(step_dir))
        mark_complete(step_dir, step, folder_checksums(step_dir))  # as the checkpointer does
    for step in incomplete_steps:  # a save that never finished: data, but no marker
        shutil.copytree(step_dir, run_dir / "checkpoint" / f"step-{step}",
                        ignore=shutil.ignore_patterns("COMPLETE"))
    return run_dir, states


# Candidate prompts: the test uses those whose greedy first token is a word piece ('▁that'),
# the case where the completion decoded alone loses its space (which ones depends on the
# checkpoint's weights and tokenizer, so they are picked at run time).
CANDIDATE_PROMPTS = ["The meaning of life is", "Python", "It that", "With", "The", "In the",
                     "This is", "For", "When", "If", "Return", "import", "A", "It is", "You"]
