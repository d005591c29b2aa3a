"""Hugging Face `tokenizers` tokenizers: a tokenizer.json file, its folder, or a Hub name (read
from the local cache when offline). One of the formats torchllm.data.tokenizer.load_tokenizer
tells apart; the "bytes" tokenizer (byte_tokenizer.py) is one of these built in memory."""

from __future__ import annotations

import json
from pathlib import Path

from torchllm.config.job_config import ConfigError
from torchllm.data.chat.jinja import template_of


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer: a tokenizer.json file, its folder, or a Hub name.

    BOS/EOS come from a tokenizer_config.json beside the file when present, else from the
    usual special-token names.
    """

    BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
    EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")

    def __init__(self, spec: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(spec)
        config, template_file = {}, None  # tokenizer_config.json: named by chat template errors
        if path.is_dir():
            path = path / "tokenizer.json"
        if path.suffix == ".json":
            if not path.is_file():
                raise ConfigError(f"tokenizer file {path} does not exist")
            try:
                self.tok = _Tok.from_file(str(path))
            except Exception as e:  # the Rust side raises a generic Exception
                raise ConfigError(f"tokenizer file {path} is not a tokenizer.json: {e}") from None
            cfg_file = path.with_name("tokenizer_config.json")
            if cfg_file.is_file():
                config, template_file = read_config(cfg_file), cfg_file
        else:
            from torchllm.hub import offline_note, prepare_hub

            offline = prepare_hub()
            try:
                self.tok = _from_hub(str(spec), offline)
            except Exception as e:
                raise ConfigError(hub_failure_message(str(spec), e) + offline_note(offline),
                                  "data.tokenizer") from None
        self.path = path
        self.chat_template_file = template_file
        self.config = config  # tokenizer_config.json: special tokens, chat_template
        self.chat_template = template_of(config)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(config.get("bos_token"), self.BOS_NAMES, "BOS")
        self.eos_id = self._special(config.get("eos_token"), self.EOS_NAMES, "EOS")
        self.special_ids = frozenset(
            [i for i, t in self.tok.get_added_tokens_decoder().items() if t.special]
            + [self.bos_id, self.eos_id]
        )

    def _special(self, configured, names, what: str) -> int:
        if isinstance(configured, dict):
            configured = configured.get("content")
        if configured is not None and not isinstance(configured, str):
            raise ConfigError(f"{self.chat_template_file}: {what.lower()}_token is "
                              f"{configured!r}, not a token's text (e.g. \"<s>\"); fix it or "
                              "remove it (the usual names are then looked for)", "data.tokenizer")
        for name in ([configured] if configured else []) + list(names):
            tid = self.tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ConfigError(f"tokenizer {self.path} has no {what} token (looked for {', '.join(names)})")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def read_config(path: Path) -> dict:
    """A tokenizer_config.json beside a tokenizer.json: a JSON object, else a ConfigError
    naming the file (one line; a config is data from whoever published the tokenizer)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(f"{path} is not a JSON tokenizer config ({reason}); fix it, or remove "
                          "it to use the tokenizer without it (BOS/EOS from the usual token "
                          "names, no chat template)", "data.tokenizer") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object of "
                          "settings (bos_token, eos_token, chat_template, ...); fix it, or remove "
                          "it to use the tokenizer without it", "data.tokenizer")
    return config


def _from_hub(name: str, offline: bool):
    """tokenizer.json of a Hub repo: downloaded (or cached), or offline from the cache only,
    failing at once when it is not there (the Rust loader would retry the network first)."""
    from tokenizers import Tokenizer as _Tok

    if not offline:
        return _Tok.from_pretrained(name)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "tokenizer.json")
    if not isinstance(cached, str):
        raise FileNotFoundError(f"{name}/tokenizer.json is not in the local Hugging Face cache")
    return _Tok.from_file(cached)


def hub_failure_message(name: str, error: Exception) -> str:
    """Why a Hub tokenizer did not load, and the ways to a working one (one line)."""
    reason = " ".join(str(error).split())[:300]
    return (
        f"data.tokenizer = {name!r} is not a file and could not be loaded from the Hugging Face "
        f"Hub ({type(error).__name__}: {reason}). Online: check the name (gated models such as "
        f"meta-llama/* need `hf auth login` and an accepted license). Offline: on a "
        f"machine with network run `hf download {name} tokenizer.json "
        f"--local-dir DIR`, copy DIR here and set data.tokenizer = 'DIR/tokenizer.json'; or "
        "set 'auto' to train a SentencePiece model on data.dataset"
    )
