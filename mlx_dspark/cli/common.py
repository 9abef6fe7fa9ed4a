"""What the ``mlx-dspark`` subcommands share: the user-facing error, the model and sampling
arguments, loading the pair, and turning a refused request into a flag's error.

Free of MLX at import (MLX, the models and the tokenizer are imported inside ``load_pair``), so
``mlx-dspark convert`` and ``--help`` stay quick."""

from __future__ import annotations

import argparse
import signal
import sys

from ..checkpoint.integrity import VERIFY_LEVELS
from ..request import AUTO_DRAFT, DEFAULT_SCHEME, FLAGS, MODES, SCHEMES, SEEDS, RequestError, \
    check_penalties, check_sampling
from ..stats import format_progress


class CommandError(Exception):
    """A one-line error for the user; the CLI prints it and exits 1."""


class CatchInterrupt:
    """While active, Ctrl-C (SIGINT) sets ``hit`` instead of raising KeyboardInterrupt, so no
    model call is torn in half. ``once``: a second Ctrl-C raises as usual (a command that
    would otherwise wait for the next token to notice)."""

    def __init__(self, once: bool = False):
        self.once, self.hit = once, False

    def __enter__(self):
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        self.hit = True
        if self.once:
            signal.signal(signal.SIGINT, self._old)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


class PrefillMeter:
    """A prefill's progress callback for ``generate``, ``chat`` and ``cache-prompt`` (its
    ``progress``): its progress on stderr (tokens, rate, time left) once it has taken
    ``SHOW_AFTER`` seconds, so a short prompt shows nothing; on a terminal one line rewritten
    in place and cleared at the end, else a line per piece. After a Ctrl-C caught by
    ``interrupt`` (while it is active), an unfinished prefill stops before its next piece:
    KeyboardInterrupt (without one, Ctrl-C raises it as usual)."""

    SHOW_AFTER = 1.0

    def __init__(self, interrupt: CatchInterrupt | None = None):
        self.interrupt, self.reused = interrupt, 0

    def __call__(self, done: int, total: int, seconds: float):
        if self.interrupt is not None and self.interrupt.hit and done < total:
            raise KeyboardInterrupt
        if seconds == 0.0:              # the start: the tokens already held
            self.reused = done
        if seconds < self.SHOW_AFTER:
            return
        line = format_progress(done, total, self.reused, seconds)
        if sys.stderr.isatty():
            sys.stderr.write("\r" + (line if done < total else "") + "\x1b[K")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def utf8_text(text: str, what: str) -> str:
    """``text`` when it is valid Unicode; a command line or a terminal holding bytes that are
    not UTF-8 gives lone surrogates (Python's surrogateescape), refused here in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        bad = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        raise CommandError(f"{what} is not UTF-8 text ({bad} at character {e.start})") from None
    return text


DTYPES = ("bfloat16", "float16", "float32")


def add_model_arguments(p: argparse.ArgumentParser, many_drafters: bool = False) -> None:
    p.add_argument("--model", metavar="DIR|REPO",
                   help="a Nemotron-H target: a directory (converted by mlx-dspark convert, "
                        "mlx-lm's layout, or a Hugging Face BF16 download; docs/formats.md), or "
                        "a Hugging Face repo id (mlx-lm's layout loads as it is; a ModelOpt or "
                        "BF16 export is converted on first use into $MLX_DSPARK_CACHE, "
                        "~/.cache/mlx-dspark, and reused after); default: the embedded demo "
                        "pair, a small demonstration model, not Nemotron")
    p.add_argument("--drafter", metavar="mtp|none|DIR|REPO", action="append" if many_drafters
                   else "store",
                   help="mtp: the target's own MTP block; or a converted DSpark or DFlash "
                        "drafter or EAGLE-3 head (directory or repo id); none: serial decoding "
                        "only. Without --model: dspark (default), mtp, eagle3 or dflash name "
                        "the demo "
                        "drafters. With --model the default is the drafter made for that model "
                        "when its config is one mlx-dspark knows (Nemotron 3.5 Lightning: "
                        "NVIDIA's DSpark drafter, from the local cache or by its repo id), "
                        "else none"
                        + ("; repeat it to compare drafters in one run (serial once, then "
                           "each drafter at every --num-draft, interleaved per prompt)"
                           if many_drafters else ""))
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the library's)")
    p.add_argument("--verify", choices=VERIFY_LEVELS, default="auto",
                   help="how much of the checkpoints to check against their conversion receipts "
                        "before loading: auto (default: all of a small checkpoint, sizes and "
                        "sampled blocks of a large one), full, fast, or none (needed for a "
                        "directory without a receipt)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="load even when the pair looks too large for the device's memory")


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("-m", "--max-tokens", type=_positive, default=max_tokens, metavar="N",
                   help=f"most tokens to generate (default {max_tokens})")
    p.add_argument("--temp", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 keeps all tokens")
    p.add_argument("--seed", type=_seed, metavar="S",
                   help="random seed for sampling, 0 to 2**64-1 (-1 or no --seed: a random "
                        "one, shown by --stats); gives the same text in every --speculative "
                        "mode (unless --sampling rejection: then in the same mode)")
    add_scheme_argument(p)
    add_penalty_arguments(p)
    add_num_draft_argument(p)
    p.add_argument("--speculative", choices=MODES, default="auto",
                   help="auto: speculate only while it pays (default); on: always; off: never")
    p.add_argument("--reasoning", choices=("on", "off"),
                   help="turn the chat template's reasoning on or off, where it has the switch")
    p.add_argument("--thinking-token-budget", type=_at_least(0), metavar="N",
                   help="most tokens the model thinks before the engine closes its thinking "
                        "block and it answers (default: no cap)")
    add_template_arguments(p)


def add_penalty_arguments(p: argparse.ArgumentParser) -> None:
    """mlx-lm's min-p and repetition penalty flags, and OpenAI's presence and frequency
    penalties (docs/sampling.md, "Penalties and processors"); all exact under speculation."""
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="keep tokens at least P times as likely as the most likely (0 = off)")
    p.add_argument("--min-tokens-to-keep", type=int, default=1, metavar="N",
                   help="tokens --min-p never filters out (default 1)")
    p.add_argument("--repetition-penalty", type=float, metavar="R",
                   help="divide the logits of recent tokens by R (> 1 repeats less; off "
                        "without it)")
    p.add_argument("--repetition-context-size", type=int, default=20, metavar="N",
                   help="the recent tokens --repetition-penalty looks at, prompt included "
                        "(default 20)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="A",
                   help="subtract A from the logit of every token generated so far (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="A",
                   help="subtract A per time a token was generated so far (-2..2)")


PENALTY_FLAGS = ("min_p", "min_tokens_to_keep", "repetition_penalty", "repetition_context_size",
                 "presence_penalty", "frequency_penalty")


def add_template_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-args", type=json_object, default={}, metavar="JSON",
                   help="variables for the chat template as a JSON object, e.g. "
                        "'{\"enable_thinking\": false}' (mlx-lm's flag)")


def json_object(s: str) -> dict:
    """An argparse type: a JSON object."""
    import json
    try:
        value = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {s!r}")
    return value


json_object.__name__ = "JSON object"


def add_system_prompt_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system-prompt", "--system", dest="system_prompt", metavar="TEXT",
                   help="a system message before the prompt (through the chat template)")


def add_stats_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stats", action="store_true",
                   help="print a summary to standard error: mode, tokens/s, mean accepted per "
                        "round, acceptance by position, peak memory")
    p.add_argument("--verbose", dest="stats", nargs="?", const=True, default=False,
                   type=_boolean, metavar="BOOL",
                   help="the same as --stats; mlx-lm's spelling (--verbose False: no summary)")


def _boolean(s: str) -> bool:
    """An argparse type: mlx-lm's str2bool words."""
    if s.lower() in ("true", "t", "yes", "1"):
        return True
    if s.lower() in ("false", "f", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, not {s!r}")


def add_scheme_argument(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--sampling", choices=SCHEMES, default=default,
                   help="rejection: accepts the most drafts; reproducible: a seed fixes the "
                        "text whatever the drafter does, at some acceptance "
                        "(docs/sampling.md); default: " + (default or "reproducible with "
                        "--seed, else rejection"))


def _at_least(low: int, high: int | None = None):
    """An argparse type: an int no smaller than ``low`` (and no larger than ``high``)."""
    def parse(s: str) -> int:
        n = int(s)
        if n < low or (high is not None and n > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {n}")
        return n
    parse.__name__ = "int"    # argparse names the type in "invalid int value"
    return parse


_positive = _at_least(1)


def num_draft(s: str) -> int | str:
    """An argparse type: a draft length >= 1, or "auto" (chosen each round)."""
    return AUTO_DRAFT if s == AUTO_DRAFT else _positive(s)


num_draft.__name__ = "draft length"


def add_num_draft_argument(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    p.add_argument("--num-draft", type=num_draft, nargs="+" if sweep else None,
                   default=[3] if sweep else 3, metavar="N|auto",
                   help="tokens the drafter proposes per round (default 3); auto: each "
                        "round's length chosen for the most tokens per unit of time"
                        + ("; several values sweep them in one run" if sweep else ""))


def _seed(s: str) -> int | None:
    """An argparse type: a seed in [0, 2**64), or -1 for a random one (llama.cpp's spelling)."""
    n = int(s)
    if n == -1:
        return None
    if not 0 <= n < SEEDS:
        raise argparse.ArgumentTypeError(f"{s}: a seed is 0 to 2**64-1 (or -1 for a random one)")
    return n


_seed.__name__ = "seed"


def load_pair(args: argparse.Namespace):
    """The pair named by --model/--drafter/--dtype, or the embedded demo pair; the sampling
    options are checked first, so a typo costs no loading time."""
    from .. import loading

    if hasattr(args, "sampling"):      # generate, chat, bench (serve checks its own defaults)
        try:
            check_sampling(args.temp, args.top_p, getattr(args, "top_k", 0),
                           args.sampling or DEFAULT_SCHEME, getattr(args, "min_p", 0.0),
                           getattr(args, "min_tokens_to_keep", 1))
            if hasattr(args, "repetition_penalty"):     # generate, chat
                check_penalties(args.repetition_penalty, args.repetition_context_size,
                                args.presence_penalty, args.frequency_penalty)
        except RequestError as e:
            raise flag_error(e) from None

    if args.model is None and not (loading.DEMO / "target").is_dir():
        raise CommandError(f"the embedded demo pair is not installed ({loading.DEMO / 'target'} is "
                           f"missing); pass --model DIR [--drafter DIR]")
    drafter = args.drafter
    if drafter is None and args.model is not None:
        drafter = "auto"            # the drafter made for this model, when one is known
    try:
        pair = loading.load(args.model, drafter, dtype=args.dtype, verify=args.verify,
                        memory_check=not args.no_memory_check, warm=False,
                        allowed_local_media_path=getattr(args, "allowed_local_media_path",
                                                         None))
    except (OSError, ValueError) as e:   # the loaders name the file and the problem
        raise CommandError(_one_line(e)) from None
    if loading.kernel_cache_cold():
        print(f"mlx-dspark {args.command}: first run on this machine: MLX compiles its CPU "
              f"kernels now (about a minute; later runs reuse them)", file=sys.stderr,
              flush=True)
    loading.warm_up(pair, getattr(args, "num_draft", 3))
    return pair


def require_chat_template(pair, args: argparse.Namespace) -> None:
    if not getattr(pair.tokenizer, "has_chat_template", False):
        raise CommandError(f"{args.model or 'the demo model'}: the tokenizer has no chat "
                           f"template; use `mlx-dspark generate` without --chat, "
                           f"--system-prompt or --reasoning for plain completion")


def request_options(args: argparse.Namespace) -> dict:
    """The API keywords (:func:`mlx_dspark.api.make_request`) the sampling flags set."""
    return dict(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, num_draft=args.num_draft,
                speculative=args.speculative, sampling=args.sampling,
                thinking_token_budget=args.thinking_token_budget,
                **{name: getattr(args, name) for name in PENALTY_FLAGS})


def flag_error(e: ValueError) -> CommandError:
    """A refused request as one line that names the flag (request.FLAGS) instead of the API
    keyword."""
    text = _one_line(e)
    flag = FLAGS.get(getattr(e, "param", None))
    if flag is not None and text.startswith(e.param):
        text = flag + text[len(e.param):]
    return CommandError(text)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
