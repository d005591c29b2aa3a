"""Train a SentencePiece BPE tokenizer on text files (what data.tokenizer = 'auto' trains on a
run's data, for files of your own):

    python -m torchllm.tools.train_tokenizer --input corpus/ more.jsonl --vocab-size 32000 --out tok/

The files are read as `local:` data (.txt: one document per file; .jsonl/.parquet: one per row,
--text-column); the training itself is torchllm.data.tokenizer_training.train_sentencepiece.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchllm.config.job_config import ConfigError
from torchllm.config.sections import Data
from torchllm.data.dataset import documents
from torchllm.data.tokenizer import SentencePieceTokenizer
from torchllm.data.tokenizer_training import train_sentencepiece


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.tools.train_tokenizer",
                                     description="train a SentencePiece BPE model on text files")
    parser.add_argument("--input", nargs="+", required=True,
                        help=".txt/.jsonl/.parquet files, globs or folders")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", required=True, help="folder to write tokenizer.model into")
    parser.add_argument("--text-column", default="text", help="column of .jsonl/.parquet rows")
    parser.add_argument("--max-chars", type=int, default=200_000_000,
                        help="stop reading text after this many characters")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"training a {args.vocab_size}-piece SentencePiece BPE tokenizer on "
          f"{' '.join(args.input)} (up to {args.max_chars:,} characters)", file=sys.stderr)
    try:
        texts = (t for spec in args.input
                 for t in documents(Data(dataset=f"local:{spec}", text_column=args.text_column)))
        out = train_sentencepiece(texts, args.vocab_size, Path(args.out) / "tokenizer.model",
                                  args.threads, args.max_chars, progress=False,
                                  vocab_key="--vocab-size", source=" ".join(args.input))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = SentencePieceTokenizer(out)
    print(f"wrote {out} ({tok.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
