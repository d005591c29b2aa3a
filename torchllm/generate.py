"""Complete prompts with a trained checkpoint (the run's config and tokenizer come with it).

    python -m torchllm.generate --checkpoint outputs/debug_model --prompt "The meaning of life is"
        [--prompt ...] [--max-new-tokens N] [--temperature 0] [--top-k K] [--top-p P]
        [--seed S] [--print-ids]
    python -m torchllm.generate --checkpoint outputs/debug_sft --chat "What is 2 + 2?" [--system S]

--chat renders a user turn with the run's chat template (torchllm.data.chat) and prints the
assistant's reply, stopping at the end-of-turn token.

Temperature 0 is greedy decoding. Unset sampling options take the run's [eval] values.
"""

from __future__ import annotations

import argparse
import sys

from torchllm.data.chat import ChatTemplate
from torchllm.eval.generation import generate
from torchllm.eval.loading import CHECKPOINT_HELP, inference_device, load_for_inference
from torchllm.log import init_logger, logger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--checkpoint", required=True, help=CHECKPOINT_HELP)
    add("--prompt", action="append", help="text to complete; repeat for a batch")
    add("--chat", action="append", help="a user message to answer (chat template); repeatable")
    add("--system", help="--chat: a system message before each user message")
    add("--max-new-tokens", type=int)
    add("--temperature", type=float, help="0 = greedy")
    add("--top-k", type=int, help="0 = no limit")
    add("--top-p", type=float, help="1 = no limit")
    add("--seed", type=int, help="default: the run's job.seed")
    add("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    add("--print-ids", action="store_true", help="also print the generated token ids")
    args = parser.parse_args(argv)
    if bool(args.prompt) == bool(args.chat):
        parser.error("pass --prompt (text completion) or --chat (a user message), not both")

    init_logger()
    try:
        device = inference_device(args.device)
        model, cfg, tokenizer = load_for_inference(args.checkpoint, device)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        logger.error("error: %s", e)
        return 2
    e = cfg.eval
    pick = lambda value, default: default if value is None else value  # noqa: E731
    eos_id = tokenizer.eos_id
    if args.chat:
        try:
            template = ChatTemplate(tokenizer)
        except ValueError as err:
            logger.error("error: --chat: %s", err)
            return 2
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [template.prompt(system + [{"role": "user", "content": m}]) for m in args.chat]
        eos_id = template.end_of_turn  # stop at the end of the assistant's turn
    else:
        prompts = [tokenizer.encode(p, bos=True) for p in args.prompt]
    try:
        outputs = generate(
            model, prompts,
            max_new_tokens=pick(args.max_new_tokens, e.max_new_tokens),
            temperature=pick(args.temperature, e.temperature),
            top_k=pick(args.top_k, e.top_k),
            top_p=pick(args.top_p, e.top_p),
            seed=pick(args.seed, cfg.job.seed),
            eos_id=eos_id,
        )
    except ValueError as err:
        logger.error("error: %s", err)
        return 2
    for prompt, ids in zip(prompts, outputs):
        if args.chat:  # the reply alone, without its end-of-turn token
            print(tokenizer.decode(ids[:-1] if ids and ids[-1] == eos_id else ids))
        else:
            print(tokenizer.decode(prompt + ids))
        if args.print_ids:
            print("ids:", " ".join(map(str, ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
