"""The command transcripts quoted in README.md and docs/*.md, produced from today's code.

A transcript is a fenced block right after an HTML comment that names it::

    <!-- transcript: speculative-on -->
    ```console
    $ mlx-dspark generate -p "def fibonacci(n):" -m 32 --speculative on --stats
    (output: written by this script)
    ```

Each ``$ `` line is a command, run by bash at the repository root with this Python's scripts
(``mlx-dspark``, ``python``) first on PATH; the lines under it, up to the next ``$ `` line or
the closing fence, are its standard output and error as a terminal shows them.

    python docs/transcripts.py            # rerun every transcript, rewrite the stale ones
    python docs/transcripts.py --all      # rewrite them all (fresh timings too)
    python docs/transcripts.py --check    # change nothing; exit 1 naming each stale block

``--check`` compares line by line after masking what depends on the machine: numbers followed
by a unit of time, speed or memory (tokens/s, GB, s, x ...). Put ``varies`` after the name
(``<!-- transcript: NAME varies -->``) when the numbers themselves depend on timing
(``--speculative auto``, ``bench``): then every number and the mode word are masked, and the
text and line layout are still checked. Everything else (the generated text, tokens, rounds,
accepted per round, acceptance by position, finish) must match exactly, so use greedy decoding
or a fixed ``--seed``. Outputs are produced on MLX's CPU backend, as in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*transcript:\s*([\w.-]+)((?:\s+[\w-]+)*)\s*-->\s*$")
FLAGS = {"varies"}
# A number followed by a unit of time, speed or memory (tokens/s, GB, 1.5s, 2.10x).
TIMING = re.compile(r"\d+(?:\.\d+)?(?=\s*(?:tokens/s|tok/s|[KMG]i?B\b|ms\b|s\b|x\b))")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
MODE = re.compile(r"\b(?:serial|speculative)\b")
TIMEOUT_S = 600


@dataclass
class Block:
    doc: Path
    name: str
    flags: set[str]
    start: int          # 0-based index of the first line inside the fence
    end: int            # index of the closing fence
    lines: list[str]    # the lines inside the fence

    @property
    def where(self) -> str:
        try:
            doc = self.doc.relative_to(ROOT)
        except ValueError:
            doc = self.doc
        return f"{doc}:{self.start + 1} (transcript {self.name})"

    def commands(self) -> list[tuple[str, list[str]]]:
        """Each ``$ `` command with the output lines quoted under it."""
        out = []
        for line in self.lines:
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif out:
                out[-1][1].append(line)
        return out


def documents(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
            if p.is_file()]


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        flags = set(m.group(2).split())
        if flags - FLAGS:
            raise ValueError(f"{doc}:{i + 1}: unknown transcript flag(s) "
                             f"{', '.join(sorted(flags - FLAGS))}; known: {', '.join(FLAGS)}")
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"{doc}:{i + 1}: transcript {m.group(1)} must be followed by a "
                             f"fenced block")
        # CommonMark: the fence closes on a run of at least its backticks alone on a line, so a
        # transcript whose output holds a ``` block is fenced with four
        fence = re.match(r"`+", lines[i + 1]).group(0)
        end = next((j for j in range(i + 2, len(lines))
                    if re.fullmatch(fence + r"`*\s*", lines[j])), None)
        if end is None:
            raise ValueError(f"{doc}:{i + 2}: transcript {m.group(1)}: the fence never closes")
        block = Block(doc, m.group(1), flags, i + 2, end, lines[i + 2:end])
        if not block.commands():
            raise ValueError(f"{block.where}: no '$ ' command line")
        found.append(block)
    return found


def run(command: str) -> list[str]:
    """The command's output lines (stdout and stderr interleaved), trailing spaces dropped."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                f"{os.environ.get('PATH', '')}")
    p = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    lines = [line.rstrip() for line in p.stdout.splitlines()]
    if p.returncode != 0:
        raise RuntimeError(f"`{command}` exited {p.returncode}:\n" + "\n".join(lines[-20:]))
    return lines


def produce(block: Block) -> list[str]:
    """The block's lines with every command's output as today's code writes it."""
    out = []
    for command, _ in block.commands():
        out += [f"$ {command}", *run(command)]
    return out


def mask(line: str, flags: set[str]) -> str:
    if "varies" in flags:
        return MODE.sub("<mode>", NUMBER.sub("<n>", line))
    return TIMING.sub("<t>", line)


def differences(quoted: list[str], produced: list[str], flags: set[str]) -> list[str]:
    """Human-readable differences between what a document quotes and what the commands
    print, after masking (empty: the transcript is current)."""
    quoted = [line.rstrip() for line in quoted]
    if len(quoted) != len(produced):
        return [f"{len(quoted)} lines quoted, {len(produced)} produced"] + \
            [f"  quoted:   {q}\n  produced: {p}" for q, p in zip(quoted, produced)
             if mask(q, flags) != mask(p, flags)][:3]
    return [f"line {i + 1}:\n  quoted:   {q}\n  produced: {p}"
            for i, (q, p) in enumerate(zip(quoted, produced))
            if mask(q, flags) != mask(p, flags)]


def check(doc: Path) -> list[str]:
    """One message per stale transcript of ``doc``."""
    problems = []
    for block in blocks(doc):
        diff = differences(block.lines, produce(block), block.flags)
        if diff:
            problems.append(f"{block.where} is stale:\n" + "\n".join(diff))
    return problems


def write(doc: Path, everything: bool = False) -> int:
    """Rewrite the stale transcripts of ``doc`` (``everything``: all of them, timings
    included) with today's output; returns how many were rewritten."""
    lines = doc.read_text(encoding="utf-8").splitlines(keepends=True)
    changed = 0
    for block in reversed(blocks(doc)):     # from the end, so earlier indices stay valid
        produced = produce(block)
        if everything or differences(block.lines, produced, block.flags):
            lines[block.start:block.end] = [line + "\n" for line in produced]
            changed += 1
    if changed:
        doc.write_text("".join(lines), encoding="utf-8")
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a transcript is stale")
    parser.add_argument("--all", action="store_true",
                        help="rewrite every transcript, not only the stale ones (fresh timings)")
    parser.add_argument("docs", nargs="*", type=Path,
                        help="documents (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    docs = args.docs or documents()
    if args.check:
        problems = [p for doc in docs for p in check(doc)]
        print("\n".join(problems) or f"transcripts current in {len(docs)} documents")
        return 1 if problems else 0
    for doc in docs:
        n = write(doc, everything=args.all)
        print(f"{doc}: {n} transcript(s) rewritten" if n else f"{doc}: current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
