"""Complete prompts with a trained checkpoint (the run's config and tokenizer come with it).

    python -m torchllm.generate --checkpoint outputs/debug_model --prompt "The meaning of life is"
        [--prompt ...] [--max-new-tokens N] [--temperature 0] [--top-k K] [--top-p P]
        [--seed S] [--print-ids]

Temperature 0 is greedy decoding. Unset sampling options take the run's [eval] values.
"""

from __future__ import annotations

import argparse
import sys

from torchllm.eval.generation import generate
from torchllm.eval.loading import inference_device, load_for_inference
from torchllm.log import init_logger, logger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run folder (latest complete step), its checkpoint folder, or a step folder")
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to complete; repeat for a batch of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="0 = no limit")
    parser.add_argument("--top-p", type=float, default=None, help="1 = no limit")
    parser.add_argument("--seed", type=int, default=None, help="default: the run's job.seed")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    parser.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    args = parser.parse_args(argv)

    init_logger()
    try:
        device = inference_device(args.device)
        model, cfg, tokenizer = load_for_inference(args.checkpoint, device)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        logger.error("error: %s", e)
        return 2
    e = cfg.eval
    pick = lambda value, default: default if value is None else value  # noqa: E731
    prompts = [tokenizer.encode(p, bos=True) for p in args.prompt]
    try:
        outputs = generate(
            model, prompts,
            max_new_tokens=pick(args.max_new_tokens, e.max_new_tokens),
            temperature=pick(args.temperature, e.temperature),
            top_k=pick(args.top_k, e.top_k),
            top_p=pick(args.top_p, e.top_p),
            seed=pick(args.seed, cfg.job.seed),
            eos_id=tokenizer.eos_id,
        )
    except ValueError as err:
        logger.error("error: %s", err)
        return 2
    for prompt, ids in zip(prompts, outputs):
        print(tokenizer.decode(prompt + ids))
        if args.print_ids:
            print("ids:", " ".join(map(str, ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
