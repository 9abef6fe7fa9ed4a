"""The ``mlx-dspark`` command.

Each subcommand is one row of ``COMMANDS``: a name, a one-line help, a function that adds its
arguments, and a handler ``run(args) -> int``. Handlers import their heavy modules lazily so
``mlx-dspark convert`` and ``verify`` never load MLX. Exit codes: 0 done; 1 an error meant for
the user (``USER_ERRORS``: one line on stderr); 2 a usage error (argparse's code, one line too);
130 Ctrl-C; 141 standard output closed early (``| head``: nothing more is written, no message).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

from .. import __version__
from ..checkpoint.integrity import CheckpointError
from ..converter.errors import ConversionError
from ..request import NonFiniteLogits
from . import commands
from .common import CommandError
from .interrupted import interrupted

USER_ERRORS: tuple[type[Exception], ...] = (ConversionError, CommandError, CheckpointError,
                                            NonFiniteLogits)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC",
                   help="ModelOpt Hugging Face export: a local directory or a repo id")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output directory")
    p.add_argument("--revision", metavar="REV",
                   help="revision to fetch (default: the pinned one, else main)")
    p.add_argument("--repo-id", metavar="ID",
                   help="the repo a local SRC was downloaded from, to check it against the pins")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it holds a previous conversion")
    p.add_argument("--no-mtp", dest="keep_mtp", action="store_false",
                   help="drop the target's native MTP block (mtp.*); kept by default, for "
                        "--drafter mtp")
    p.add_argument("--keep-mtp", dest="keep_mtp", action="store_true", default=True,
                   help=argparse.SUPPRESS)      # the old spelling; keeping is the default now
    p.add_argument("--pins", metavar="FILE",
                   help="pin file to check the source against (default: the packaged "
                        "MERERUN_CONVERSION.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _convert(args: argparse.Namespace) -> int:
    from ..converter import convert
    convert(args.src, args.out, revision=args.revision, repo_id=args.repo_id,
            force=args.force, keep_mtp=args.keep_mtp, pins_path=args.pins,
            progress=False if args.no_progress else None)
    return 0


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a model directory")


def _verify(args: argparse.Namespace) -> int:
    from ..checkpoint.recorded import verify_directory
    print(verify_directory(args.dir))
    return 0


COMMANDS: list[Command] = [
    Command("convert", "convert a ModelOpt NVFP4/FP8 export to the MLX layout, bit for bit",
            _convert_arguments, _convert),
    Command("generate", commands.GENERATE_HELP, commands.generate_arguments,
            commands.run_generate),
    Command("chat", commands.CHAT_HELP, commands.chat_arguments, commands.run_chat),
    Command("bench", commands.BENCH_HELP, commands.bench_arguments, commands.run_bench),
    Command("verify", "check every byte of a model directory against its conversion receipt (one "
                      "without a receipt: against the hashes recorded at its first load)",
            _verify_arguments, _verify),
    Command("serve", commands.SERVE_HELP, commands.serve_arguments, commands.run_serve),
    Command("cache-prompt", commands.CACHE_PROMPT_HELP, commands.cache_prompt_arguments,
            commands.run_cache_prompt),
]


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit code 2, as argparse has it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} "
                     f"--help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="mlx-dspark",
        description="Nemotron-H with NVIDIA's DSpark speculative drafter on MLX")
    parser.add_argument("--version", action="version", version=f"mlx-dspark {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


# mlx-lm's flags (and llama.cpp's) that mlx-dspark spells differently.
OUR_SPELLING = {"--draft-model": "--drafter", "--num-draft-tokens": "--num-draft",
                "--chat-template-config": "--chat-template-args", "--temperature": "--temp",
                "--max-tokens-to-generate": "--max-tokens"}


def unknown_flags(command: str, extra: list[str]) -> str:
    """The usage error for arguments ``command`` does not take, naming ours where mlx-lm's
    spelling was used."""
    hints = [f"{flag} is {OUR_SPELLING[flag]} here" for flag in
             (a.split("=", 1)[0] for a in extra) if flag in OUR_SPELLING]
    return (f"mlx-dspark {command}: error: unrecognized arguments: {' '.join(extra)}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f" (see mlx-dspark {command} --help)\n")


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:
            parser.exit(2, unknown_flags(args.command, extra))
        return args.run(args)
    except USER_ERRORS as e:
        print(f"mlx-dspark {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted(args.command if args is not None else None)
    except BrokenPipeError:
        # The reader left (`| head`): point stdout at /dev/null so that the interpreter's final
        # flush does not complain again, and end quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
