"""data.tokenizer = "bytes": UTF-8 bytes as tokens (ids 0-255 are the byte values), then BOS and
EOS (256, 257). Nothing to train, download or ship: the character-level recipes (nanoGPT's tiny
Shakespeare, whose text is ASCII, so one character is one token) run from the text alone.

It is a Hugging Face `tokenizers` byte-level tokenizer without merges, built in memory, so it
encodes at Rust speed and the HF export writes it as a tokenizer.json that `AutoTokenizer` loads
with the same ids (torchllm.hf.tokenizer handles it like any tokenizer.json).
"""

from __future__ import annotations

from torchllm.data.tokenizer_json import HFTokenizer

BYTES = "bytes"  # the data.tokenizer value
BOS, EOS = "<|bos|>", "<|eos|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_tokenizer():
    """A `tokenizers.Tokenizer`: byte b -> id b, BOS -> 256, EOS -> 257."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # GPT-2's split keeps the pieces short (no merges: the ids do not depend on it).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False),
                            AddedToken(EOS, special=True, normalized=False)])
    # Exported (AutoTokenizer with add_special_tokens): BOS first, as the run starts documents.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


class ByteTokenizer(HFTokenizer):
    """UTF-8 bytes + BOS/EOS (258 ids)."""

    def __init__(self):  # noqa: D107 (no file: HFTokenizer's loading is skipped)
        self.tok = byte_level_tokenizer()
        self.spec = BYTES  # the data.tokenizer value that loads it (checkpoints record it)
        self.path = None
        self.config = {"bos_token": BOS, "eos_token": EOS}
        self.chat_template = None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self.tok.token_to_id(BOS)
        self.eos_id = self.tok.token_to_id(EOS)
        self.special_ids = frozenset([self.bos_id, self.eos_id])

    def __repr__(self) -> str:
        return "ByteTokenizer(258 ids: 256 bytes, BOS, EOS)"
