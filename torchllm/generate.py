"""Complete prompts with a trained checkpoint (the run's config and tokenizer come with it).

    python -m torchllm.generate --checkpoint outputs/debug_model --prompt "The meaning of life is"
        [--prompt ...] [--max-new-tokens N] [--temperature 0] [--top-k K] [--top-p P]
        [--seed S] [--print-ids]
    python -m torchllm.generate --checkpoint outputs/debug_model --interactive
    python -m torchllm.generate --checkpoint outputs/debug_sft --chat "What is 2 + 2?" [--system S]
    python -m torchllm.generate --checkpoint outputs/debug_sft --chat --interactive   # multi-turn
        [--section.key=value ...]                 (overrides of the run's config)

Temperature 0 is greedy decoding. Unset sampling options take the run's [eval] values (which
--eval.key=value overrides, e.g. --eval.max_new_tokens=32, as for the eval CLIs).
--interactive reads one prompt per line from stdin (until end of input, Ctrl-D) and prints each
completion token by token as it is generated. Completions stop at EOS and never show special
tokens. The completion is the text exactly as the tokenizer decodes prompt + completion together
(cut at the prompt's length), so no space is lost at the boundary. --prompt and --chat print
each prompt (or question) under its own header line, then its completion (or reply):

    ### prompt 1                     ### user 1
    The meaning of life is           What is 2 + 2?
    ### completion 1                 ### assistant 1
     a number that ...               4
"""

from __future__ import annotations

import argparse
import itertools
import sys

from torchllm.config import ConfigError
from torchllm.data.chat.template import ChatTemplate
from torchllm.data.tokenizer import readable
from torchllm.eval.generation import completion_text, generate, generate_stream
from torchllm.eval.loading import (CHECKPOINT_HELP, OVERRIDES_HELP, inference_device,
                                   load_for_inference, parse_args_and_overrides)
from torchllm.log import init_logger, logger


def stream_completion(tokenizer, ids, out, prompt: list[int] = ()) -> list[int]:
    """Write the text of `ids` (an iterator of token ids) to `out` as it grows; returns the ids.

    The text is what `ids` add after `prompt` when both are decoded together (completion_text).
    Text is written only once it is stable: a token may end in the middle of a multi-byte
    character, which decodes as U+FFFD until the next token completes it.
    """
    seen: list[int] = []
    written = 0
    for token in ids:
        seen.append(token)
        text = completion_text(tokenizer, prompt, seen)
        stable = len(text.rstrip("\ufffd"))
        if stable > written:
            out.write(text[written:stable])
            out.flush()
            written = stable
    text = completion_text(tokenizer, prompt, seen)
    out.write(text[written:] + "\n")
    out.flush()
    return seen


def stdin_lines(stdin, hint: str):
    """The non-empty lines of `stdin`, without their newline; on a terminal, `hint` first and
    a "> " prompt before each line."""
    tty = stdin.isatty()
    if tty:
        print(hint, file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def interactive(model, tokenizer, sampling: dict, stdin, stdout) -> int:
    """One completion per line of `stdin`, streamed; returns the number of prompts answered."""
    answered = 0
    for prompt in stdin_lines(stdin, "Type a prompt and press Enter; Ctrl-D quits."):
        ids = tokenizer.encode(prompt, bos=True)
        try:
            stdout.write(readable(tokenizer, ids))  # the prompt as the model reads it
            stream_completion(tokenizer, generate_stream(model, ids, **sampling), stdout, ids)
        except ValueError as err:  # e.g. a prompt longer than the model's context
            stdout.write("\n")
            logger.error("error: %s", err)
            continue
        answered += 1
    return answered


def chat_session(model, tokenizer, template, sampling: dict, first: list[str], system: list,
                 stdin, stdout) -> int:
    """A multi-turn conversation: each line of `stdin` (after the `first` messages) is the
    user's next turn, answered with the whole conversation so far as the prompt. Returns the
    number of replies."""
    history, turn = list(system), 0
    messages = itertools.chain([m for m in first if m.strip()],
                               stdin_lines(stdin, "Type a message and press Enter; Ctrl-D quits."))
    for message in messages:
        history.append({"role": "user", "content": message})
        try:
            (ids,) = generate(model, [template.prompt(history)], **sampling)
        except ValueError as err:  # the conversation outgrew the model's context
            history.pop()
            logger.error("error: %s", err)
            continue
        reply = ids[:-1] if ids and ids[-1] == sampling["eos_id"] else ids
        text = tokenizer.decode(reply)
        history.append({"role": "assistant", "content": text})
        turn += 1
        print(f"### user {turn}\n{message}\n### assistant {turn}\n{text}", file=stdout,
              flush=True)
    return turn


def main(argv: list[str] | None = None, stdin=None, stdout=None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    parser = argparse.ArgumentParser(prog="python -m torchllm.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=OVERRIDES_HELP, allow_abbrev=False)
    add = parser.add_argument
    add("--checkpoint", required=True, help=CHECKPOINT_HELP)
    add("--prompt", action="append", help="text to complete; repeat for a batch")
    add("--interactive", action="store_true",
        help="read prompts from stdin, one per line, and stream each completion")
    add("--chat", action="append", nargs="?", const="",
        help="a user message to answer (chat template); repeatable; with --interactive, a "
             "multi-turn conversation (the message, if any, is its first turn)")
    add("--system", help="--chat: a system message before each user message")
    add("--max-new-tokens", type=int)
    add("--temperature", type=float, help="0 = greedy")
    add("--top-k", type=int, help="0 = no limit")
    add("--top-p", type=float, help="1 = no limit")
    add("--seed", type=int, help="default: the run's job.seed")
    add("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    add("--print-ids", action="store_true", help="also print the generated token ids")
    init_logger()
    try:
        args, overrides = parse_args_and_overrides(parser, argv)
    except ValueError as e:  # ConfigError: an argument that is neither an option nor an override
        logger.error("error: %s", e)
        return 2
    chat_session_mode = args.interactive and args.chat is not None
    if chat_session_mode and args.prompt:
        parser.error("--chat --interactive is a conversation: drop --prompt")
    if not chat_session_mode and sum(map(lambda v: v is not None and v is not False,
                                         (args.prompt, args.chat, args.interactive))) != 1:
        parser.error("give one of --prompt TEXT (repeatable), --chat MESSAGE (repeatable), "
                     "--interactive, or --chat --interactive (a multi-turn conversation)")
    if args.chat is not None and not chat_session_mode and not all(m.strip()
                                                                   for m in args.chat):
        parser.error("--chat needs a message (or add --interactive for a conversation)")
    try:
        device = inference_device(args.device)
        model, cfg, tokenizer = load_for_inference(args.checkpoint, device, overrides)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        logger.error("error: %s", e)
        return 2
    e = cfg.eval
    pick = lambda value, default: default if value is None else value  # noqa: E731
    sampling = dict(
        max_new_tokens=pick(args.max_new_tokens, e.max_new_tokens),
        temperature=pick(args.temperature, e.temperature),
        top_k=pick(args.top_k, e.top_k),
        top_p=pick(args.top_p, e.top_p),
        seed=pick(args.seed, cfg.job.seed),
        eos_id=tokenizer.eos_id,
    )
    if args.interactive and not chat_session_mode:
        interactive(model, tokenizer, sampling, stdin, stdout)
        return 0
    if args.chat is not None:
        try:
            template = ChatTemplate(tokenizer)
        except ConfigError:  # its own message names a training key: not what helps here
            logger.error(
                "error: --chat: %s was not trained on conversations (its tokenizer has no chat "
                "template and no chat tokens), so it has no assistant turn to answer in; "
                "complete text with --prompt \"...\" instead, or fine-tune it on conversations "
                "first: a new run on a chat: source from it (e.g. CONFIG_FILE="
                "train_configs/llama3_debug_sft.toml ./run_train.sh "
                "--checkpoint.initial_load_path=%s), then --chat that run", args.checkpoint,
                args.checkpoint)
            return 2
        except ValueError as err:  # a template that cannot render
            logger.error("error: --chat: %s", err)
            return 2
        system = [{"role": "system", "content": args.system}] if args.system else []
        sampling["eos_id"] = template.end_of_turn  # stop at the end of the assistant's turn
        if chat_session_mode:
            chat_session(model, tokenizer, template, sampling, args.chat, system, stdin, stdout)
            return 0
        prompts = [template.prompt(system + [{"role": "user", "content": m}]) for m in args.chat]
    else:
        prompts = [tokenizer.encode(p, bos=True) for p in args.prompt]
    try:
        outputs = generate(model, prompts, **sampling)
    except ValueError as err:
        logger.error("error: %s", err)
        return 2
    for i, ids in enumerate(outputs):
        if args.chat:  # the reply alone, without its end-of-turn token, under its question
            # The template encodes each turn's content on its own, between special tokens, so
            # the reply decodes on its own too (as its content was encoded in training).
            reply = ids[:-1] if ids and ids[-1] == sampling["eos_id"] else ids
            print(f"### user {i + 1}\n{args.chat[i]}\n### assistant {i + 1}", file=stdout)
            print(tokenizer.decode(reply), file=stdout)
        else:
            print(f"### prompt {i + 1}\n{readable(tokenizer, prompts[i])}\n"
                  f"### completion {i + 1}", file=stdout)
            print(completion_text(tokenizer, prompts[i], ids), file=stdout)
        if args.print_ids:
            print("ids:", " ".join(map(str, ids)), file=stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
