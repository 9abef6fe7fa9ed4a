"""``mlx-dspark convert``: a ModelOpt Hugging Face export -> the MLX layout of ARCHITECTURE.md.

Order of work: resolve the source, plan and validate everything from headers and configs,
then stream tensor bytes into a temporary directory next to OUT while a second thread hashes
the source files against the pins, write the receipt, and rename into place only on success.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import ConversionError
from .hub import resolve_source
from .plan import TARGET, build_plan
from .layout import GROUP_SIZE, LAYOUT, RECEIPT_NAME
from .quant_config import fill_layer_pattern, load_json, parse_quant_spec
from .receipts import PinCheck, load_pins, receipt
from .safetensors_io import OutTensor, SourceFiles, sha256_file, write_safetensors

SHARD_BYTES = 5 << 30                    # fixed, so shard boundaries never depend on the machine
METADATA = {"format": "mlx"}
COPIED_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                "merges.txt", "chat_template*", "generation_config.json"]


def shard(tensors: list[OutTensor], limit: int = SHARD_BYTES) -> list[list[OutTensor]]:
    """Greedy, in name order: a tensor starts a new shard when it would overflow this one."""
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def source_files(src: Path) -> list[str]:
    """Every file of the source (skipping dot-directories such as a local-dir .cache)."""
    names = []
    for root, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(src)
        names += [(rel / f).as_posix() for f in files if not f.startswith(".")]
    return sorted(names)


def _hash_sources(src: Path, names: list[str], check: PinCheck, stop) -> dict:
    out = {}
    for name in names:
        size, sha = sha256_file(src / name, stop.is_set)
        check.check_file(name, size, sha)
        out[name] = {"size": size, "sha256": sha}
    return out


def _prepare_out(out: Path, force: bool, src: Path) -> None:
    if out.resolve() == src or src in out.resolve().parents:
        raise ConversionError(f"{out}: output must not be the source directory or inside it")
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise ConversionError(f"{out}: already exists (pass --force to replace it)")
    if not out.is_dir() or (any(out.iterdir()) and not (out / RECEIPT_NAME).is_file()):
        raise ConversionError(f"{out}: refusing to replace: not a converted checkpoint "
                              f"(no {RECEIPT_NAME})")


def convert(src: str, out: str | Path, *, revision: str | None = None,
            repo_id: str | None = None, force: bool = False, keep_mtp: bool = False,
            pins_path: str | Path | None = None, progress: bool | None = None,
            shard_bytes: int = SHARD_BYTES) -> Path:
    from mlx_dspark import __version__

    pins = load_pins(pins_path)
    source = resolve_source(src, revision, pins, repo_id)
    s = source.path
    out = Path(out).expanduser().absolute()
    _prepare_out(out, force, s)
    check = PinCheck(source.repo_id, source.revision, pins, s)

    config = load_json(s / "config.json")
    spec = parse_quant_spec(s, config)
    plan = build_plan(s, config, spec, keep_mtp=keep_mtp)
    if plan.kind == TARGET:
        config = fill_layer_pattern(config, s / "config.json")
    config["quantization"] = {"layout": LAYOUT, "group_size": GROUP_SIZE,
                              "source_quant_algo": spec.algo, "modules": plan.modules}
    copies = sorted(n for n in os.listdir(s) if (s / n).is_file()
                    and any(fnmatch.fnmatchcase(n, p) for p in COPIED_FILES))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)                             # mkdtemp's 0700 is for the partial state only
    pool, stop = ThreadPoolExecutor(1), threading.Event()
    files = SourceFiles()
    try:
        hashing = pool.submit(_hash_sources, s, source_files(s), check, stop)
        outputs = _write_tensors(tmp, plan.tensors, files, hashing, progress, shard_bytes)
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (tmp / "config.json").write_text(text, encoding="utf-8")
        for name in copies:
            shutil.copyfile(s / name, tmp / name)
        for name in ["config.json", *copies]:
            size, sha = sha256_file(tmp / name)
            outputs[name] = {"size": size, "sha256": sha}
        hashed = hashing.result()
        (tmp / RECEIPT_NAME).write_text(receipt(
            version=__version__, layout=LAYOUT, kind=plan.kind, options={"keep_mtp": keep_mtp},
            repo_id=source.repo_id, revision=source.revision, source_files=hashed,
            pins=check.summary(), outputs=outputs), encoding="utf-8")
        if out.exists():                      # --force: swap, then drop the old one
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / out.name)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except OSError as e:
        raise ConversionError(f"{e.filename or out}: {e.strerror or e}") from None
    finally:
        stop.set()
        files.close()
        pool.shutdown(wait=True, cancel_futures=True)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _report(check.summary(), source, out, plan)
    return out


def _write_tensors(tmp: Path, tensors, files, hashing, progress, shard_bytes) -> dict:
    from tqdm import tqdm

    groups = shard(tensors, shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    outputs = {}
    bar = tqdm(total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True,
               unit_divisor=1024, desc="convert", file=sys.stderr,
               disable=(None if progress is None else not progress))

    def advance(n):
        bar.update(n)
        if hashing.done() and hashing.exception() is not None:
            hashing.result()     # a pin mismatch found by the hashing thread: stop now

    try:
        for name, group in zip(names, groups):
            size, sha = write_safetensors(tmp / name, group, METADATA, files, advance)
            outputs[name] = {"size": size, "sha256": sha}
    finally:
        bar.close()
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: n for n, g in zip(names, groups) for t in g}}
        path = tmp / "model.safetensors.index.json"
        path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        size, sha = sha256_file(path)
        outputs[path.name] = {"size": size, "sha256": sha}
    return outputs


def _report(pins: dict, source, out: Path, plan) -> None:
    what = source.repo_id or str(source.path)
    if pins["status"] == "pinned":
        note = f"source verified against pins ({len(pins['verified_files'])} files)"
    else:
        detail = pins.get("detail") or f"{len(pins.get('unpinned_files', []))} files unpinned"
        note = f"source is {pins['status']}: {detail}; hashes recorded in {RECEIPT_NAME}"
    print(f"converted {what} ({plan.kind}, {len(plan.tensors)} tensors; {plan.dropped} source "
          f"tensors dropped: input/KV-cache scales, MTP) -> {out}\n{note}", file=sys.stderr)
