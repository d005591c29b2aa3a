"""The user's journey without seams (issue 29), through the commands a user types, offline, on
local data the test writes:

    ./run_train.sh                              pre-train on a novel (data.tokenizer = auto)
    CONFIG_FILE=...midtrain.toml ./run_train.sh  mid-train: the novel + a streamed local folder
    CONFIG_FILE=...sft.toml ./run_train.sh       SFT on a chat JSONL (the base has no chat tokens)
    python -m torchllm.eval.downstream ...      HellaSwag from a local file
    python -m torchllm.hf export ... a transformers folder, tokenizer included
    python -m torchllm.generate --chat ...      torchllm's greedy reply

and transformers' greedy reply on the exported folder (its own tokenizer and chat template) must
equal torchllm's, text and ids. Each stage runs what its command runs, in the test's process
(tests/cli.py: run_train.sh's launcher with one process, the module's main), each reading the
run the stage before it wrote; only the sizes are tiny. (The same commands as processes, from a
fresh clone: tests/e2e/test_fresh_clone.py and the README's in tests/e2e/test_docs_commands.py.)
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from cli import DEBUG_CONFIG, run_module, run_train
from conftest import SHARED, shared_path

pytestmark = pytest.mark.e2e  # what users type: the e2e tier (-m e2e)

# The shipped configs, shrunk: a user's own --section.key=value overrides.
TINY = ["--training.device=cpu", "--model.flavor=debug", "--training.steps=3",
        "--training.seq_len=48", "--training.local_batch_size=4", "--metrics.log_freq=1",
        "--lr_scheduler.warmup_steps=1", "--training.mixed_precision=none",
        "--metrics.progress_bar=false", "--job.print_config=false"]
QUESTION = "Who kept the lighthouse?"
MAX_NEW = 12


ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run(cmd: list[str], config: str | None = None) -> str:
    """One command as a user types it (from the checkout: `./run_train.sh ARGS` with one
    process, `python -m MODULE ARGS`), run by tests/cli.py; its output, asserted exit code 0."""
    if cmd[0] == "./run_train.sh":
        ran = run_train(*cmd[1:], config=config or DEBUG_CONFIG, env=ENV)
    else:
        assert cmd[:2] == ["python", "-m"], cmd
        ran = run_module(cmd[2], *cmd[3:], env=ENV)
    shown = " ".join(cmd)
    assert ran.returncode == 0, f"{config or ''} {shown} exited {ran.returncode}:\n" \
        f"{ran.out[-4000:]}"
    return ran.out


WORDS = ("the old keeper walked along the harbour wall while rain came over the grey water "
         "and the lamp turned slowly above the rocks she remembered her brother who had sailed "
         "north many winters ago with letters never answered the village slept under slate "
         "roofs gulls cried boats knocked against the quay and somewhere a bell rang twice "
         "nobody spoke of the wreck yet everyone listened for the sound of the engine").split()
NAMES = ["Maren", "Tobias", "Elspeth", "Captain Rook", "the doctor", "old Hale"]


def write_novel(path: Path, chapters: int = 6, paragraphs: int = 8) -> Path:
    """A novel-like text as people save it: CRLF line ends, no blank lines, long paragraphs
    (each one line of ~1,500 characters), chapter headings. Deterministic."""
    rng = random.Random(29)
    lines = []
    for c in range(1, chapters + 1):
        lines.append(f"CHAPTER {c}")
        for _ in range(paragraphs):
            sentences = []
            for _ in range(rng.randint(12, 20)):
                words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
                sentence = f"{rng.choice(NAMES)} " + " ".join(words)
                if rng.random() < 0.3:
                    sentence = f'"{sentence[0].upper()}{sentence[1:]}," said {rng.choice(NAMES)}'
                sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!."))
            lines.append(" ".join(sentences))
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return path


def write_stream_folder(folder: Path, files: int = 4, rows: int = 12) -> Path:
    """A local folder `datasets` streams as a Hub dataset would be (jsonl parts, `text`)."""
    folder.mkdir()
    rng = random.Random(7)
    for f in range(files):
        with (folder / f"part-{f:05d}.jsonl").open("w") as out:
            for r in range(rows):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
                out.write(json.dumps({"text": f"Log entry {f}-{r}: {text}."}) + "\n")
    return folder


def write_chat(path: Path, n: int = 40) -> Path:
    rng = random.Random(3)
    rows = []
    for i in range(n):
        who = rng.choice(NAMES)
        rows.append({"messages": [
            {"role": "user", "content": rng.choice([QUESTION, "Who rang the bell?",
                                                    "Where did the boats go?"])},
            {"role": "assistant", "content": f"{who} did, {i % 5 + 1} times, by the harbour."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assistant_block(out: str) -> str:
    """The reply under `### assistant 1` in generate's output (up to the next header)."""
    m = re.search(r"^### assistant 1\n(.*?)(?=^### |^ids: |\Z)", out, re.S | re.M)
    assert m, f"no '### assistant 1' block in generate's output:\n{out[-2000:]}"
    return m.group(1).removesuffix("\n")


@pytest.mark.slow
def test_the_users_journey_through_the_commands(tmp_path):
    transformers = pytest.importorskip("transformers")
    novel = write_novel(tmp_path / "novel.txt")
    stream = write_stream_folder(tmp_path / "logbook")
    chat = write_chat(tmp_path / "chat.jsonl")
    runs = tmp_path / "outputs"
    common = [f"--job.dump_folder={runs}", *TINY]

    # 1. Pre-train: the quick-start command on the user's own text, the tokenizer trained on it.
    out = run(["./run_train.sh", *common, f"--data.dataset=local:{novel}",
               "--data.tokenizer=auto", "--data.tokenizer_vocab_size=384",
               "--checkpoint.enable=true"])
    pretrain = runs / "debug_model"
    assert (pretrain / "checkpoint" / "step-3" / "COMPLETE").is_file(), out[-3000:]
    (tok,) = (pretrain / "data").glob("tokenizer_*sp384.model")

    # 2. Mid-train on the novel + the streamed folder, from the pre-training weights. Without
    # chat tokens (text only), so that SFT below starts from a base that has none. The shipped
    # config's data.tokenizer = "from_initial_load": the pre-training's auto-trained file.
    out = run(["./run_train.sh", *common,
               f"--data.sources=local:{novel}=0.7,hf:{stream}=0.3", "--data.val_documents=2",
               "--data.chat_tokens=false", f"--checkpoint.initial_load_path={pretrain}"],
              config="train_configs/llama3_debug_midtrain.toml")
    midtrain = runs / "debug_midtrain"
    assert (midtrain / "checkpoint" / "step-3" / "COMPLETE").is_file(), out[-3000:]
    assert f"hf:{stream}" in out and re.search(r"step +3/3", out), out[-3000:]
    # the stage's tokenizer: the file the pre-training trained, named with the key's value
    assert any("from_initial_load" in line and str(tok) in line for line in out.splitlines()), \
        out[-3000:]

    # 3. SFT on the chat file from the mid-training weights: the chat tokens are new, the
    # embedding rows grow at load.
    # A few more steps at a higher rate: a reply that is not one token repeated, so that the
    # comparison with transformers below has positions and different tokens to get wrong.
    out = run(["./run_train.sh", *common,
               f"--data.dataset=chat:{chat}", f"--checkpoint.initial_load_path={midtrain}",
               "--training.steps=8", "--optimizer.lr=3e-3"],
              config="train_configs/llama3_debug_sft.toml")
    sft = runs / "debug_sft"
    assert (sft / "checkpoint" / "step-8" / "COMPLETE").is_file(), out[-3000:]
    assert re.search(r"\b384 -> 390\b", out), out[-3000:]  # the vocabulary grown at load
    assert f'python -m torchllm.generate --checkpoint {sft} --chat "' in out  # what to run next
    done = re.search(r"done: step 8/8.*loss ([\d.]+) -> ([\d.]+)", out)
    assert done and float(done[2]) < float(done[1]), out[-3000:]  # it learned the replies

    # Each stage wrote its own report; the lifecycle's three stages on shared axes (issue 31).
    assert all((r / "report" / "report.md").is_file() for r in (pretrain, midtrain, sft))
    run(["python", "-m", "torchllm.report", str(pretrain), str(midtrain), str(sft)])
    lifecycle = runs / "reports" / "debug_model_vs_debug_midtrain_vs_debug_sft" / "report.md"
    text = lifecycle.read_text()
    assert all(f"## Run {r.name}" in text for r in (pretrain, midtrain, sft)), text[:2000]
    assert (lifecycle.parent / "loss.png").is_file()

    # 4. Downstream eval: HellaSwag from a local file.
    source = SHARED / "data" / "hellaswag_val.jsonl"
    if source.is_file():
        evals = tmp_path / "evals"
        evals.mkdir()
        with source.open() as f:
            (evals / "hellaswag.jsonl").write_text("".join(next(f) for _ in range(6)))
        out = run(["python", "-m", "torchllm.eval.downstream", "--checkpoint", str(sft),
                   "--tasks", "hellaswag", "--data-dir", str(evals), "--limit", "4",
                   "--json", str(tmp_path / "core.json"), "--device", "cpu"])
        result = json.loads((tmp_path / "core.json").read_text())
        hs = result["tasks"]["hellaswag"]
        assert hs["n"] == 4 and 0 <= hs["acc"] <= 1, result
        assert re.search(r"^\s*hellaswag\b.*\d", out, re.M), out[-3000:]

    # 5. Export to a transformers folder, tokenizer and chat template included.
    hf_dir = tmp_path / "hf"
    run(["python", "-m", "torchllm.hf", "export", "--checkpoint", str(sft),
         "--out", str(hf_dir)])
    assert "chat_template" in json.loads((hf_dir / "tokenizer_config.json").read_text())

    # 6. torchllm's greedy chat reply ...
    out = run(["python", "-m", "torchllm.generate", "--checkpoint", str(sft),
               "--chat", QUESTION, "--temperature", "0", "--max-new-tokens", str(MAX_NEW),
               "--device", "cpu", "--print-ids"])
    ours = assistant_block(out)
    (ids_line,) = [line for line in out.splitlines() if line.startswith("ids: ")]
    our_ids = [int(i) for i in ids_line.removeprefix("ids: ").split()]

    # ... equals transformers' on the exported folder, with its own tokenizer and template.
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    with torch.no_grad():
        generated = model.generate(torch.tensor([list(prompt)]), max_new_tokens=MAX_NEW,
                                   do_sample=False, pad_token_id=hf_tok.eos_token_id)
    reply_ids = generated[0, len(prompt):].tolist()
    assert len(set(our_ids)) > 2, our_ids  # a reply with something to compare
    assert reply_ids == our_ids  # the same tokens, the end-of-turn token (if reached) included
    stops = json.loads((hf_dir / "config.json").read_text())["eos_token_id"]
    if reply_ids and reply_ids[-1] in stops:  # torchllm does not show the end of turn
        reply_ids = reply_ids[:-1]
    assert hf_tok.decode(reply_ids, skip_special_tokens=True) == ours

    # Everything else passed; without the shared HellaSwag file, its step did not run: say so.
    shared_path("data", "hellaswag_val.jsonl")
