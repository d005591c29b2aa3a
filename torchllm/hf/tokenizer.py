"""The run's tokenizer in a Hugging Face export, always: `AutoTokenizer` loads it and gives the
run's ids.

    SentencePiece   tokenizer.model (+ the added chat tokens in tokenizer_config.json)
    tiktoken        tokenizer.json: a byte-level BPE with the merges recovered from the ranks,
                    the tokenizer's own pre-tokenization regex and special tokens (GPT-2, Llama 3)
    tokenizer.json  the run's file (+ the added chat tokens) and its tokenizer_config.json

Every tokenizer adds BOS in front of a text, as torchllm does for each document. A run that
trained on conversations also gets the `chat_template` it trained with: the tokenizer's own, or
the Jinja text of torchllm's rendering (chat_template.fallback_template), so that
`apply_chat_template(..., add_generation_prompt=True)` gives the prompt ids the run's own
generation would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torchllm.data.byte_tokenizer import bytes_to_unicode
from torchllm.data.chat.jinja import fallback_template


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges behind tiktoken ranks, in rank order. tiktoken merges any two adjacent
    parts whose concatenation has a rank, lowest rank first; so every split of a token into two
    ranked parts is a merge with the token's priority (ties: the lower-ranked parts first), as
    transformers' TikTokenConverter does. (Some Llama 3 tokens are reachable only that way.)"""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges += sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))
    return merges


def tiktoken_json(enc, specials: list[str], bos: str):
    """A `tokenizers.Tokenizer` equal to the tiktoken Encoding `enc` on ordinary text, with
    `specials` added in id order after the ranks and BOS prepended to every text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ranks = enc._mergeable_ranks  # noqa: SLF001 - tiktoken keeps no public accessor
    table = bytes_to_unicode()
    text = lambda b: "".join(table[x] for x in b)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),  # noqa: SLF001
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tok


def _added(tokenizer) -> list[str]:
    """The chat tokens a ChatTokenizer adds after its base vocabulary, in id order."""
    added = getattr(tokenizer, "added", None) if hasattr(tokenizer, "base") else None
    return sorted(added, key=added.get) if added else []


def chat_template_for(tokenizer, chat: bool) -> tuple[str, int] | None:
    """(the template a run trained with, its end-of-turn id): the tokenizer's own, the 6 added
    tokens' (for a SentencePiece base with a space where its dummy prefix puts one), or Llama
    3's headers; None for a run that did not train on conversations."""
    from torchllm.data.chat.template import ChatTemplate

    if not (chat or _added(tokenizer)):
        return None
    try:
        ours = ChatTemplate(tokenizer)
    except ValueError:  # no template and no chat tokens: nothing to write
        return None
    if ours.kind == "jinja":
        return tokenizer.chat_template, ours.end_of_turn
    template = fallback_template(ours.kind)
    sp = getattr(tokenizer, "sp", None)
    if sp is not None and sp.id_to_piece(sp.encode("a")[0]).startswith("\u2581"):
        template = template.replace("+ message['content']", "+ ' ' + message['content']")
    return template, ours.end_of_turn


def write_tokenizer(tokenizer, out: Path, hf_config: dict, chat: bool = False) -> str | None:
    """Write the run's tokenizer files into the export folder `out`; returns what was written
    (for the log), None for a tokenizer kind it cannot write."""
    base = getattr(tokenizer, "base", tokenizer)
    added = _added(tokenizer)
    max_length = hf_config.get("max_position_embeddings") or hf_config.get("n_positions")
    config = {"model_max_length": max_length, "clean_up_tokenization_spaces": False}
    sp, enc, tok = (getattr(base, name, None) for name in ("sp", "enc", "tok"))
    if sp is not None:
        shutil.copyfile(base.path, out / "tokenizer.model")
        config.update({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                       "add_eos_token": False, "legacy": False})
        names = {"bos_token": base.bos_id, "eos_token": base.eos_id, "unk_token": sp.unk_id()}
        config.update({k: sp.id_to_piece(i) for k, i in names.items() if i >= 0})
        config["added_tokens_decoder"] = {
            str(tokenizer.added[name]): {"content": name, "special": True, "lstrip": False,
                                         "rstrip": False, "normalized": False,
                                         "single_word": False} for name in added}
        what = "SentencePiece tokenizer.model"
    elif enc is not None or tok is not None:
        if enc is not None:
            specials = sorted(enc._special_tokens, key=enc._special_tokens.get)  # noqa: SLF001
            bos = enc.decode_single_token_bytes(base.bos_id).decode()
            hf = tiktoken_json(enc, specials, bos)
            what = "tokenizer.json (from the tiktoken ranks)"
        else:
            from tokenizers import Tokenizer

            hf = Tokenizer.from_str(tok.to_str())
            config.update({k: v for k, v in getattr(base, "config", {}).items()
                           if k not in ("chat_template",)})
            what = "tokenizer.json"
        from tokenizers import AddedToken

        hf.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in added])
        wrong = [n for n in added if hf.token_to_id(n) != tokenizer.added[n]]
        if wrong:
            raise ValueError(f"the added chat tokens {wrong} do not get the run's ids")
        hf.save(str(out / "tokenizer.json"))
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config["bos_token"] = hf.id_to_token(base.bos_id)
        config["eos_token"] = hf.id_to_token(base.eos_id)
    else:
        return None
    hf_config.update({"bos_token_id": base.bos_id, "eos_token_id": base.eos_id})
    if found := chat_template_for(tokenizer, chat):
        config["chat_template"], end_of_turn = found
        what += " with the chat template"
        if end_of_turn != base.eos_id:  # generate() stops at the end of the assistant's turn
            hf_config["eos_token_id"] = [base.eos_id, end_of_turn]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return what
