"""Step 1: the corpus (this machine's Python standard library source) and the held-out prompts.

Every machine with Python has the standard library's source offline, and code is predictable,
which is where speculation pays. Files are split train / held-out by file with a fixed seed,
so held-out perplexity and acceptance are measured on code the models never saw.

    /work/venv-fx/bin/python training/data.py        # writes training/work/{train,heldout}.txt
"""
import hashlib
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
SEED = 1234
HELDOUT_FRACTION = 0.05
# Test suites are huge and repetitive; site-packages is not the standard library.
SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def file_key(path) -> str:
    """The first 12 hex digits of a file's SHA-256: which weights a cache was made from."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def stdlib_dir():
    return Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"


def source_files(root):
    files = [p for p in sorted(root.rglob("*.py")) if not SKIP_PARTS & set(p.relative_to(root).parts)]
    return [p for p in files if p.stat().st_size > 0]


def split(files, seed=SEED):
    rng = random.Random(seed)
    shuffled = list(files)
    rng.shuffle(shuffled)
    n_held = max(1, int(len(shuffled) * HELDOUT_FRACTION))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def read(path):
    return path.read_text(encoding="utf-8", errors="replace")


def main():
    root = stdlib_dir()
    train, held = split(source_files(root))
    WORK.mkdir(exist_ok=True)
    # A form feed separates files: the models learn that a new file starts fresh.
    for name, files in (("train", train), ("heldout", held)):
        text = "\f".join(read(p) for p in files)
        (WORK / f"{name}.txt").write_text(text, encoding="utf-8")
        (WORK / f"{name}_files.json").write_text(json.dumps([str(p.relative_to(root)) for p in files], indent=0))
        print(f"{name}: {len(files)} files, {len(text)/1e6:.2f} M chars")


if __name__ == "__main__":
    main()
