"""Which tokenizer a checkpoint's weights belong to, and the one check that a checkpoint meets the
tokenizer it was trained with (resume, initial load, inference).

A checkpoint's COMPLETE marker records its tokenizer (`tokenizer_record`: the base tokenizer's
file or Hub name, its SHA-256, its ids and whether the 6 chat tokens were added); a Hugging Face
folder's is its own tokenizer file (`hf_folder_tokenizer`). `check_same_tokenizer` compares a
record with the tokenizer in use wherever weights are loaded: the checkpoint reader (resume,
initial load, vocab growth in vocab_resize.py), inference (torchllm.run.tokenizer) and export.
The reader (checkpoint/step.py) calls it, so every consumer checks the same way; a stage
choosing its tokenizer (data.tokenizer = 'from_initial_load' / 'auto') is the run's:
torchllm/run/tokenizer.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from torchllm.config.job_config import ConfigError
from torchllm.log import logger

NEW = "train"  # data.tokenizer = "train": a new SentencePiece model, even for a stage
FROM_INITIAL_LOAD = "from_initial_load"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def hf_folder_tokenizer(folder: str | Path) -> tuple[Path, bool] | None:
    """(tokenizer file, whether the 6 chat tokens follow its vocabulary) of a Hugging Face model
    folder: its tokenizer.json (added tokens are inside), else its tokenizer.model (SentencePiece
    or tiktoken; chat tokens when tokenizer_config.json adds torchllm's 6 after the vocabulary,
    as export writes them); None when it has neither. ConfigError for other added tokens, and
    for a file the folder's store refuses (a link, too large, not JSON: torchllm/hf_folder.py)."""
    try:
        return _hf_folder_tokenizer(folder)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # one line naming the file, exit 2 (not a traceback)
        raise ConfigError(str(e), "checkpoint.initial_load_path") from None


def _hf_folder_tokenizer(folder: str | Path) -> tuple[Path, bool] | None:
    from torchllm.data.chat.tokens import ADDED_TOKENS
    from torchllm.data.tokenizer import load_tokenizer
    from torchllm.hf_folder import has_file, hf_store, read_json

    store = hf_store(folder)  # plain files only, no link followed, bounded reads
    found = [Path(store.where(n)) for n in HF_TOKENIZER_FILES if has_file(store, n)]
    if not found:
        return None
    if found[0].name == "tokenizer.json":
        return found[0], False
    config = store.where("tokenizer_config.json")
    decoder = read_json(store, "tokenizer_config.json").get("added_tokens_decoder", {}) \
        if has_file(store, "tokenizer_config.json") else {}
    size = load_tokenizer(found[0]).vocab_size
    try:
        added = {int(i): t.get("content") for i, t in decoder.items() if int(i) >= size}
    except (AttributeError, TypeError, ValueError):
        raise ConfigError(f"{config}: added_tokens_decoder must map token ids to token objects "
                          "(as transformers saves it)", "data.tokenizer") from None
    if not added:
        return found[0], False
    if added != {size + i: name for i, name in enumerate(ADDED_TOKENS)}:
        raise ConfigError(f"{config} adds tokens {sorted(added.values())} after the "
                          f"{size} ids of {found[0]}; torchllm adds only its 6 chat tokens "
                          f"({', '.join(ADDED_TOKENS)}): save the tokenizer as a tokenizer.json",
                          "data.tokenizer")
    return found[0], True


def hf_record(folder: str | Path) -> dict | None:
    """The tokenizer record (as a marker's) of a Hugging Face folder's tokenizer file."""
    found = hf_folder_tokenizer(folder)
    if found is None:
        return None
    from torchllm.hf_folder import hf_store, tokenizer_bytes

    data = tokenizer_bytes(hf_store(folder), found[0].name)  # bounded, no link followed
    return {"name": str(found[0]), "base_sha256": hashlib.sha256(data).hexdigest(),
            "chat_tokens": found[1]}


def tokenizer_record(tokenizer, new: bool = False) -> dict:
    """What the checkpoint marker records of the run's tokenizer: its name, its ids, and its base
    vocabulary (the tokenizer before the added chat tokens) with the base file's SHA-256; `new`
    (recorded only when true): a stage that trained its own (data.tokenizer = 'train') instead
    of taking checkpoint.initial_load_path's."""
    from torchllm.data.tokenizer import tokenizer_name, tokenizer_sha256

    base = getattr(tokenizer, "base", tokenizer)
    digest, name = tokenizer_sha256(tokenizer), tokenizer_name(tokenizer)
    return {"name": name,  # what load_tokenizer (and data.tokenizer = from_initial_load) reads
            "vocab_size": int(tokenizer.vocab_size), "base_vocab_size": int(base.vocab_size),
            "base_sha256": digest, "chat_tokens": base is not tokenizer,
            **({"new": True} if new else {})}



def _named(record: dict) -> str:
    digest = record.get("base_sha256")
    chat = " + 6 chat tokens" if record.get("chat_tokens") else ""
    return f"{record['name']}{chat}" + (f" (sha256 {digest[:12]})" if digest else "")


HINTS = {
    "resume": "a run resumes with the tokenizer it trained with: relaunch with the run's "
              "data.tokenizer (its config.toml), or start a new run (another job.run_name)",
    "initial load": "use the checkpoint's (data.tokenizer = 'auto' or 'from_initial_load' "
                    f"takes it), or set data.tokenizer = {NEW!r} to train a new one on purpose",
    "inference": "restore that file (or pass --data.tokenizer=FILE with it)",
}


def hub_sha256(name: str) -> str | None:
    """SHA-256 of the tokenizer.json of Hub repo `name` in the local Hugging Face cache (never
    the network: what `hf download NAME tokenizer.json` or an online run left there), or None."""
    if name == "bytes":
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "tokenizer.json")
    except ValueError:  # not a Hub repo id (HFValidationError)
        return None
    return sha256_of(cached) if isinstance(cached, str) else None


def check_same_tokenizer(saved: dict | None, now: dict | None, where: str, use: str) -> None:
    """The one check that the tokenizer `now` (tokenizer_record) is the one the
    weights at `where` were trained with (`saved`, the record in its marker): the same base
    tokenizer by the SHA-256 of its file (by name when neither is a file; a file against a Hub
    name: against the Hub repo's tokenizer.json in the local cache, `hub_sha256`, and refused
    when that is not there: the two cannot be told apart). `use`: 'resume', 'initial load' or 'inference' (which also needs
    the same ids: chat tokens included). A differing one is a ConfigError naming both, except
    at an initial load with data.tokenizer = 'train' (now['new']): a warning. The ids added to
    the same base (chat tokens) are vocab_resize.plan_growth's."""
    if not saved or not now:
        return
    a, b = saved.get("base_sha256"), now.get("base_sha256")
    unknown = ""
    if a and b:
        same = a == b
    elif a is None and b is None:
        same = saved["name"] == now["name"]
    else:  # a file against a Hub name: the Hub repo's tokenizer.json as the local cache has it
        hub = saved if a is None else now
        digest = hub_sha256(hub["name"])
        same = digest == (a or b)
        if digest is None:
            unknown = (f" ({hub['name']} is not a file, and no tokenizer.json of it is in the "
                       "local Hugging Face cache to compare by SHA-256: `hf download "
                       f"{hub['name']} tokenizer.json` puts it there)")
    if use == "inference":
        same = same and saved.get("vocab_size") == now.get("vocab_size")
    if same:
        return
    both = (f"{where} was trained with tokenizer {_named(saved)}, but this run's is "
            f"{_named(now)}{unknown}")
    if use == "initial load" and now.get("new"):
        logger.warning("%s (data.tokenizer = %r): the loaded embedding and output rows belong "
                       "to the other tokenizer's ids, so expect a high loss at first", both, NEW)
        return
    raise ConfigError(f"{both}: the weights' ids would mean other tokens; {HINTS[use]}",
                      "data.tokenizer")
