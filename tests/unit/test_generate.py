"""Generation: the KV cache against full recomputation, sampling filters, EOS, batching, CLI."""

from __future__ import annotations

import pytest
import torch

from torchllm.eval.generation import filter_logits, generate
from torchllm.eval.loading import load_for_inference
from torchllm.generate import main
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.kv_cache import KVCache
from torchllm.models.llama.model import Transformer

from conftest import build_model
from builders.eval import CANDIDATE_PROMPTS  # noqa: F401

TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=40)
PROMPTS = [[1, 5, 9, 14, 3, 7], [1, 20], [1, 8, 8, 31, 2, 60, 11, 4, 19]]


@pytest.fixture(scope="module")
def model():
    return build_model(Transformer, TINY).eval()


def test_kv_cache_logits_equal_the_full_forward(model):
    tokens = torch.randint(0, TINY.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    cache = KVCache(max_len=20)
    # Prefill, single tokens, then a multi-token chunk (which needs the offset causal mask).
    pieces = [model(tokens[:, :5], cache)]
    pieces += [model(tokens[:, i : i + 1], cache) for i in range(5, 9)]
    pieces.append(model(tokens[:, 9:14], cache))
    assert cache.pos == 14
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)


def test_greedy_tokens_identical_with_and_without_kv_cache(model):
    cached = generate(model, PROMPTS, max_new_tokens=15, temperature=0, use_cache=True)
    uncached = generate(model, PROMPTS, max_new_tokens=15, temperature=0, use_cache=False)
    assert cached == uncached
    assert [len(ids) for ids in cached] == [15, 15, 15]
    # Batching does not change a row: each prompt alone gives the same tokens.
    for prompt, ids in zip(PROMPTS, cached):
        assert generate(model, [prompt], max_new_tokens=15, temperature=0) == [ids]
    # The cached path must not disturb training mode.
    model.train()
    generate(model, PROMPTS[:1], max_new_tokens=2)
    assert model.training
    model.eval()


def test_filters_against_hand_computed_sets():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.5)) == [1]  # 0.5 alone reaches 0.5
    assert kept(filter_logits(logits, top_p=0.7)) == [1, 3]  # 0.5 + 0.3
    assert kept(filter_logits(logits, top_p=0.81)) == [1, 2, 3]
    assert kept(filter_logits(logits, top_p=0.01)) == [1]  # the top token always stays
    assert kept(filter_logits(logits, top_k=3, top_p=0.7)) == [1, 3]
    assert kept(filter_logits(logits)) == [0, 1, 2, 3]


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    kwargs = dict(max_new_tokens=12, temperature=1.5)
    a = generate(model, PROMPTS, seed=3, **kwargs)
    assert a == generate(model, PROMPTS, seed=3, **kwargs)
    assert a != generate(model, PROMPTS, seed=4, **kwargs)
    assert generate(model, PROMPTS, seed=5, top_k=1, **kwargs) == generate(
        model, PROMPTS, max_new_tokens=12, temperature=0
    )
    sampled = generate(model, PROMPTS, seed=3, top_k=5, **kwargs)
    assert all(0 <= t < TINY.vocab_size for ids in sampled for t in ids)


def test_eos_stops_a_row_and_max_seq_len_caps(model):
    free = generate(model, PROMPTS, max_new_tokens=15, temperature=0)
    eos = free[0][3]
    stopped = generate(model, PROMPTS, max_new_tokens=15, temperature=0, eos_id=eos)
    for full, cut in zip(free, stopped):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert cut == expected
    assert len(stopped[0]) <= 4 < len(free[0])
    # 36 prompt tokens leave room for 4 more in a 40-token model.
    long_prompt = [1] + [7] * 35
    assert len(generate(model, [long_prompt], max_new_tokens=10)[0]) == 4
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 40], max_new_tokens=1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, PROMPTS, max_new_tokens=1, top_p=0)


def parse_blocks(out: str, head: str, tail: str) -> list[tuple[str, str]]:
    """[(first text, second text)] from the CLI's '### head i' / '### tail i' blocks; a block
    ends at the next header or ids line (the texts may contain newlines)."""
    blocks = []
    for i, part in enumerate(out.split(f"### {head} ")[1:], 1):
        first, second = part[len(f"{i}\n"):].split(f"\n### {tail} {i}\n")
        blocks.append((first, second.split("\nids: ")[0].removesuffix("\n")))
    return blocks


def test_cli_prints_the_completion_as_the_whole_sequence_decodes(tmp_path, capsys):
    """Each completion printed is decode(prompt + completion) after decode(prompt) (issue 29:
    decoding the completion alone loses the boundary space with SentencePiece), under its
    prompt; the ids are greedy generation's."""
    from builders.eval import write_run

    run_dir, _ = write_run(tmp_path, complete_steps=(1,), incomplete_steps=())
    model, _, tokenizer = load_for_inference(run_dir, "cpu")

    def first_piece(prompt: str) -> str:
        ids = tokenizer.encode(prompt, bos=True)
        return tokenizer.sp.id_to_piece(generate(model, [ids], 1, temperature=0)[0][0])

    word_first = [p for p in CANDIDATE_PROMPTS if first_piece(p).startswith("\u2581")][:3]
    assert len(word_first) >= 2, "no candidate prompt exercises the boundary space"
    prompts = [CANDIDATE_PROMPTS[0], *(p for p in word_first if p != CANDIDATE_PROMPTS[0])]
    argv = ["--checkpoint", str(run_dir), "--temperature", "0", "--max-new-tokens", "6",
            "--print-ids"]
    assert main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
    out = capsys.readouterr().out
    blocks = parse_blocks(out, "prompt", "completion")
    ids_lines = [line for line in out.splitlines() if line.startswith("ids: ")]
    assert len(blocks) == len(ids_lines) == len(prompts)
    boundary_space = 0
    for prompt, (shown_prompt, completion), line in zip(prompts, blocks, ids_lines):
        prompt_ids = tokenizer.encode(prompt, bos=True)
        expected = generate(model, [prompt_ids], 6, temperature=0, eos_id=tokenizer.eos_id)[0]
        assert [int(t) for t in line.split()[1:]] == expected
        whole = tokenizer.sp.decode(prompt_ids[1:] + expected)  # SentencePiece itself
        assert shown_prompt == prompt and whole.startswith(prompt)
        assert completion == whole[len(prompt):], prompt
        boundary_space += tokenizer.sp.decode(expected) != completion
    assert boundary_space >= 2  # decoding the completion alone would differ
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2


def test_cli_takes_config_overrides_like_the_eval_clis(tmp_path, capfd):
    """--section.key=value arguments override the run's config (here eval.max_new_tokens, which
    an unset --max-new-tokens takes); anything else is one error line, exit code 2."""
    from builders.eval import write_run
    from torchllm.config import load_config

    run_dir, _ = write_run(tmp_path, complete_steps=(1,), incomplete_steps=())
    default = load_config(["--job.config_file", str(run_dir / "config.toml")]).eval
    assert default.max_new_tokens > 3
    base = ["--checkpoint", str(run_dir), "--temperature", "0", "--prompt", "The", "--print-ids"]
    model, _, tokenizer = load_for_inference(run_dir, "cpu")
    lengths = []
    for flags, n in (([], default.max_new_tokens), (["--eval.max_new_tokens=3"], 3)):
        assert main(base + flags) == 0
        (line,) = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("ids: ")]
        ids = [int(t) for t in line.split()[1:]]
        assert ids == generate(model, [tokenizer.encode("The", bos=True)], n, temperature=0,
                               eos_id=tokenizer.eos_id)[0]
        lengths.append(len(ids))
    assert lengths[1] <= 3 < lengths[0]  # the override took effect
    assert main(base + ["--eval.no_such_key=1"]) == 2
    assert main(base + ["stray"]) == 2
    err = capfd.readouterr().err
    assert "eval.no_such_key" in err and "stray" in err


def test_training_forward_still_compiles_as_one_graph(model):
    """The optional cache must not add graph breaks to the training forward."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(compiled(tokens), model(tokens))
    torch._dynamo.reset()
