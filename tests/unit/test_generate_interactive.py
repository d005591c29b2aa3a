"""Streaming generation, `generate --interactive`, and readable completions (no special tokens)."""

from __future__ import annotations

import io

import pytest

from torchllm.data.tokenizer import TiktokenTokenizer, readable
from torchllm.eval.generation import generate, generate_stream
from torchllm.eval.loading import load_for_inference
from torchllm.generate import main, stream_completion
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer

from conftest import build_model, shared_path

TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=40)


@pytest.fixture(scope="module")
def model():
    return build_model(Transformer, TINY).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder with one complete step (read by the CLI tests here)."""
    from builders.eval import write_run

    return write_run(tmp_path_factory.mktemp("interactive"), complete_steps=(1,),
                     incomplete_steps=())[0]


@pytest.mark.parametrize("sampling", [
    dict(temperature=0),
    dict(temperature=0.9, top_k=20, seed=3),
    dict(temperature=1.2, top_p=0.8, seed=7, eos_id=11),
])
def test_stream_yields_the_tokens_of_full_recomputation(model, sampling):
    prompt = [1, 8, 8, 31, 2, 60]
    # Oracle: generate without the KV cache (every step reruns the whole sequence).
    expected = generate(model, [prompt], max_new_tokens=30, use_cache=False, **sampling)[0]
    assert list(generate_stream(model, prompt, max_new_tokens=30, **sampling)) == expected
    # The context limit: 6 prompt tokens leave 34 of max_seq_len 40.
    assert len(list(generate_stream(model, prompt, 100, temperature=0))) == 34
    with pytest.raises(ValueError, match="max_seq_len"):
        next(generate_stream(model, [1] * 40, 1))


def test_readable_cuts_at_eos_and_drops_special_tokens():
    tok = TiktokenTokenizer(shared_path("tokenizers", "llama3", "tokenizer.model"))
    words = tok.encode(" hello there")
    reserved = tok.enc.encode_single_token("<|reserved_special_token_5|>")
    ids = [tok.bos_id, *words[:1], reserved, *words[1:], tok.eos_id, *tok.encode(" after")]
    assert readable(tok, ids) == " hello there"
    assert "<|" in tok.decode(ids)  # what plain decode would have shown


def test_streamed_text_waits_for_whole_characters():
    tok = TiktokenTokenizer(shared_path("tokenizers", "gpt2", "gpt2.tiktoken"))
    text = " naïve café ☕ done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # splits a character

    class Recorder(io.StringIO):
        writes: list[str] = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    out = Recorder()
    assert stream_completion(tok, iter(ids), out) == ids
    assert out.getvalue() == text + "\n"
    assert len(out.writes) > 3 and not any("\ufffd" in w for w in out.writes)


def test_interactive_cli_answers_each_stdin_line(run_dir, capsys):
    from builders.eval import CANDIDATE_PROMPTS

    model, _, tokenizer = load_for_inference(run_dir, "cpu")

    def answer(prompt: str) -> tuple[str, bool]:
        """The line expected for `prompt`, and whether decoding apart would lose a space."""
        prompt_ids = tokenizer.encode(prompt, bos=True)
        ids = generate(model, [prompt_ids], 6, temperature=0, eos_id=tokenizer.eos_id)[0]
        whole = readable(tokenizer, prompt_ids + ids)  # decoded together: no lost space
        assert whole.startswith(prompt)
        return whole, whole[len(prompt):] != readable(tokenizer, ids)

    # The first prompt, and one whose completion starts with a word (picked for this checkpoint).
    spaced = next(p for p in CANDIDATE_PROMPTS if answer(p)[1])
    prompts = [CANDIDATE_PROMPTS[0], spaced] if spaced != CANDIDATE_PROMPTS[0] else [spaced]
    stdin = io.StringIO("\n\n".join(prompts) + "\n")  # an empty line between: skipped
    stdout = io.StringIO()
    assert main(["--checkpoint", str(run_dir), "--interactive", "--temperature", "0",
                 "--max-new-tokens", "6"], stdin=stdin, stdout=stdout) == 0
    assert stdout.getvalue() == "".join(answer(p)[0] + "\n" for p in prompts)
    # Neither --prompt nor --interactive: a usage error naming both.
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(run_dir)])
    assert "--interactive" in capsys.readouterr().err


def test_interactive_subprocess_streams_from_a_pipe(run_dir, monkeypatch):
    """The documented command's main, prompts piped into its stdin (sys.stdin, not a stream
    handed to main). The typed command itself runs in test_docs_commands.py (e2e)."""
    from cli import run_module

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    proc = run_module("torchllm.generate", "--checkpoint", str(run_dir), "--interactive",
                      "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("Hello") and proc.stdout.count("\n") >= 1
