"""The runtime subcommands of ``mlx-dspark``: ``generate``, ``chat`` and ``bench`` (DESIGN §3).

This module only defines arguments and handlers; MLX, the models and the tokenizer are
imported inside the handlers, so ``mlx-dspark convert`` and ``--help`` stay quick. Problems a
user can fix (a missing directory, a drafter for another target, a corrupt checkpoint, a
prompt that does not fit) raise :class:`CommandError`, which the CLI prints as one line."""

from __future__ import annotations

import argparse
import sys

from .cli_support import (CommandError, _at_least, _one_line, _positive, add_model_arguments,
                          add_sampling_arguments, add_stats_argument, add_system_prompt_argument,
                          format_stats, generation_kwargs, load_pair, require_chat_template)


# ---------------------------------------------------------------------------------------------
# generate


GENERATE_HELP = "generate a completion of one prompt, streamed to standard output"


def generate_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", metavar="TEXT",
                   help="the prompt; without it (or with '-') it is read from standard input")
    add_system_prompt_argument(p)
    template = p.add_mutually_exclusive_group()
    template.add_argument("--ignore-chat-template", action="store_true",
                          help="complete the prompt as given; by default it goes through the "
                               "model's chat template when the tokenizer has one (as mlx-lm)")
    template.add_argument("--chat", action="store_true",
                          help="require the chat template (an error when the model has none)")
    add_sampling_arguments(p, max_tokens=256)
    add_stats_argument(p)


def run_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            raise CommandError("no prompt: pass --prompt TEXT or pipe the prompt on stdin")
        prompt = sys.stdin.read()
    if not prompt:
        raise CommandError("empty prompt")
    for flag, value in (("--reasoning", args.reasoning), ("--system-prompt", args.system_prompt)):
        if value and args.ignore_chat_template:
            raise CommandError(f"{flag} applies to the chat template: drop --ignore-chat-template")
    pair = load_pair(args)
    from . import api
    from .tokenizer import encode_chat, template_options

    templated = getattr(pair.tokenizer, "has_chat_template", False) \
        and not args.ignore_chat_template
    if args.chat or (not templated and (args.reasoning or args.system_prompt)):
        require_chat_template(pair, args)
    if templated:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        prompt = encode_chat(pair.tokenizer, system + [{"role": "user", "content": prompt}],
                             template_options(pair.tokenizer, args.reasoning))[0]
    stats = None
    try:
        for chunk in api.stream_generate(pair, prompt, **generation_kwargs(args)):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            stats = chunk.stats
    except ValueError as e:    # the prompt does not fit the model, a bad sampling value
        raise CommandError(_one_line(e)) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        print("\n".join(["=========="] + format_stats(stats, args.speculative)),
              file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# chat


CHAT_HELP = "chat with the model in the terminal (/help inside lists the commands)"


def chat_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p, max_tokens=512)
    add_system_prompt_argument(p)


def run_chat(args: argparse.Namespace) -> int:
    pair = load_pair(args)
    from .chat import Chat

    require_chat_template(pair, args)
    return Chat(pair, args).run()


# ---------------------------------------------------------------------------------------------
# bench


BENCH_HELP = "serial vs speculative decoding on built-in code, math and chat prompts"


def bench_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-m", "--max-tokens", type=_at_least(4), default=64, metavar="N",
                   help="tokens generated per prompt and mode, at least 4 so that both modes "
                        "have steps to time (default 64)")
    p.add_argument("--num-draft", type=_positive, default=3, metavar="N",
                   help="tokens the drafter proposes per round (default 3)")
    p.add_argument("--repeats", type=_positive, default=1, metavar="R",
                   help="runs per prompt and mode; the median is reported (default 1)")
    p.add_argument("--domains", metavar="LIST",
                   help="comma-separated subset of the prompt domains (code,math,chat)")
    p.add_argument("--limit", type=_positive, metavar="N", help="at most N prompts per domain")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on standard output (fields: README)")
    p.add_argument("--plot", metavar="PNG",
                   help="also draw acceptance by position and speedup per domain (matplotlib)")
    p.set_defaults(speculative="auto")      # bench runs every mode


def run_bench(args: argparse.Namespace) -> int:
    from . import bench_cli
    return bench_cli.run(args)
