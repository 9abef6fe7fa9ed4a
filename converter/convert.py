"""``mlx-dspark convert``: a ModelOpt Hugging Face export -> the MLX layout of ARCHITECTURE.md.

Order of work: resolve the source, plan and validate everything from headers and configs,
then stream tensor bytes into a temporary directory next to OUT while a second thread hashes
the source files against the pins, write the receipt, and rename into place only on success.

Convert never destroys what it did not make: ``--force`` replaces OUT only when OUT is a
complete earlier conversion (or an empty directory), and the final rename never replaces an
OUT that appeared meanwhile. SIGTERM and SIGHUP clean up like Ctrl-C; the temporary
directory's name carries the owner's pid, so a later run removes what a killed one left.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .errors import ConversionError
from .hub import resolve_source
from .mlx_layouts import mlx_layout
from .omni import text_config, with_text_config, wrapper_name
from .plan import TARGET, build_plan, load_source_tensors
from .layout import GROUP_SIZE, LAYOUT, RECEIPT_NAME, load_receipt, target_tensor_names
from .quant_config import fill_layer_pattern, load_json, parse_quant_spec, tower_spec
from .receipts import RECEIPT_FORMAT, PinCheck, load_pins, receipt
from .shapes import ConfigError, check_tensors, check_values
from .safetensors_io import OutTensor, SourceFiles, open_regular, sha256_file, write_safetensors
from .source_tree import allowed_roots, source_files

SHARD_BYTES = 5 << 30                    # fixed, so shard boundaries never depend on the machine
METADATA = {"format": "mlx"}
MEDIA_STEM = "media"
"""An Omni wrapper's vision, projector and audio tensors: ``media*.safetensors``."""
COPIED_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                "merges.txt", "chat_template*", "generation_config.json",
                "preprocessor_config.json", "processor_config.json"]     # an Omni's media


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


def _hash_sources(src: Path, names: list[str], check: PinCheck, stop) -> dict:
    out = {}
    for name in names:
        size, sha = sha256_file(src / name, stop.is_set)
        check.check_file(name, size, sha)
        out[name] = {"size": size, "sha256": sha}
    return out


def _why_not_replaceable(out: Path) -> str | None:
    """None when ``--force`` may replace ``out``: an empty directory, or a complete earlier
    conversion (its receipt parses and lists exactly the files present)."""
    entries = {e.name: e for e in os.scandir(out)}
    if not entries:
        return None
    if RECEIPT_NAME not in entries:
        return f"no {RECEIPT_NAME}"
    try:
        doc = load_receipt(out)
    except (OSError, ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != RECEIPT_FORMAT:
        return f"its {RECEIPT_NAME} is not a conversion receipt"
    outputs = doc.get("outputs")
    if not isinstance(outputs, dict):
        return f"its {RECEIPT_NAME} lists no outputs"
    extra = sorted(set(entries) - set(outputs) - {RECEIPT_NAME})
    if extra:
        return f"{extra[0]!r} is not listed in its {RECEIPT_NAME}"
    missing = sorted(set(outputs) - set(entries))
    if missing:
        return f"{missing[0]!r} listed in its {RECEIPT_NAME} is missing"
    odd = [n for n, e in sorted(entries.items()) if not e.is_file(follow_symlinks=False)]
    if odd:
        return f"{odd[0]!r} is not a regular file"
    return None


def _prepare_out(out: Path, force: bool, src: Path) -> tuple[int, int] | None:
    """Decide, before any work, whether OUT may be written; returns the identity (st_dev,
    st_ino) of the OUT that ``--force`` will replace, or None when OUT does not exist."""
    real = out.resolve()
    for root in allowed_roots(src):
        if real == root or root in real.parents or real in root.parents:
            raise ConversionError(f"{out}: output must not be the source directory, inside "
                                  f"it, or a directory that contains it")
    if not os.path.lexists(out):
        return None
    if not force:
        raise ConversionError(f"{out}: already exists (pass --force to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise ConversionError(f"{out}: refusing to replace: not a directory of its own "
                              f"(a symbolic link or a file)")
    try:
        why = _why_not_replaceable(out)
    except OSError as e:
        raise ConversionError(f"{out}: cannot read it to check it ({e.strerror or e})") from None
    if why:
        raise ConversionError(f"{out}: refusing to replace: not a converted checkpoint "
                              f"({why})")
    st = os.lstat(out)
    return st.st_dev, st.st_ino


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):    # someone else's process, or not a pid we wrote
        return True
    return True


def _remove_stale(out: Path) -> None:
    """Remove what a killed run left beside OUT (its pid no longer runs). A killed ``--force``
    may have moved the old conversion aside before the new one was in place: put it back."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-(\d+)-\w+")
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return                       # no parent yet: nothing to clean
    for e in entries:
        m = pattern.fullmatch(e.name)
        if not m or not e.is_dir(follow_symlinks=False) or _pid_alive(int(m[2])):
            continue
        kept = Path(e.path) / out.name
        if m[1] == "old" and kept.is_dir() and not os.path.lexists(out):
            try:
                _rename_noreplace(kept, out)
            except OSError:
                continue             # cannot put it back: leave it where it is
        shutil.rmtree(e.path, ignore_errors=True)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails with FileExistsError instead of replacing ``dst`` (a plain rename
    silently replaces an empty directory, and racing runs would replace each other)."""
    libc = ctypes.CDLL(None, use_errno=True)
    a, b = os.fsencode(src), os.fsencode(dst)
    if hasattr(libc, "renameat2"):                       # Linux: RENAME_NOREPLACE
        rc = libc.renameat2(-100, a, -100, b, 1)         # -100: AT_FDCWD
    elif hasattr(libc, "renamex_np"):                    # macOS: RENAME_EXCL
        rc = libc.renamex_np(a, b, 4)
    else:
        rc = None
    if rc == 0:
        return
    err = errno.ENOSYS if rc is None else ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        raise OSError(err, os.strerror(err), str(dst))   # EEXIST becomes FileExistsError
    if os.path.lexists(dst):           # no atomic primitive on this filesystem: check, rename
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _install(tmp: Path, out: Path, replacing: tuple[int, int] | None) -> None:
    """Move the finished conversion to OUT, honouring the decision made at the start."""
    if replacing is None:
        try:
            _rename_noreplace(tmp, out)
        except FileExistsError:
            raise ConversionError(f"{out}: appeared while converting; left untouched (pass "
                                  f"--force to replace an earlier conversion)") from None
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    aside = old / out.name
    try:
        os.rename(out, aside)
    except BaseException:
        old.rmdir()
        raise
    st = os.lstat(aside)
    why = ("it was replaced" if (st.st_dev, st.st_ino) != replacing
           else _why_not_replaceable(aside))
    try:
        if why:
            raise ConversionError(f"{out}: changed while converting ({why}); left untouched")
        _rename_noreplace(tmp, out)
    except BaseException:
        _rename_noreplace(aside, out)
        old.rmdir()
        raise
    shutil.rmtree(old)


@contextmanager
def _terminate_like_interrupt():
    """SIGTERM and SIGHUP raise KeyboardInterrupt, so a killed conversion cleans up exactly
    as Ctrl-C does (signal handlers can only be set from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    sigs = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.signal(s, interrupt) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def convert(src: str, out: str | Path, *, revision: str | None = None,
            repo_id: str | None = None, force: bool = False, keep_mtp: bool = True,
            pins_path: str | Path | None = None, progress: bool | None = None,
            shard_bytes: int = SHARD_BYTES) -> Path:
    with _terminate_like_interrupt():
        return _convert(src, out, revision=revision, repo_id=repo_id, force=force,
                        keep_mtp=keep_mtp, pins_path=pins_path, progress=progress,
                        shard_bytes=shard_bytes)


def _convert(src, out, *, revision, repo_id, force, keep_mtp, pins_path, progress,
             shard_bytes) -> Path:
    from mlx_dspark import __version__

    pins = load_pins(pins_path)
    source = resolve_source(src, revision, pins, repo_id)
    s = source.path
    names = source_files(s)                  # refuses links out of SRC and special files first
    out = Path(out).expanduser().absolute()
    _remove_stale(out)
    replacing = _prepare_out(out, force, s)
    check = PinCheck(source.repo_id, source.revision, pins, s)

    config = load_json(s / "config.json")
    if not isinstance(config, dict):
        raise ConversionError(f"{s / 'config.json'}: not a JSON object")
    if (config.get("quantization") or {}).get("layout") == LAYOUT:
        raise ConversionError(f"{src}: already converted (its config.json has the {LAYOUT} "
                              f"layout): load it as it is (--model / --drafter)")
    mlx = mlx_layout(config, {n: t.dtype for n, t in load_source_tensors(s).items()})
    if mlx is not None:
        raise ConversionError(f"{src}: already in MLX layout ({mlx}): it loads as it is "
                              f"(--model {src}); nothing to convert, nothing written")
    wrapper = config if wrapper_name(config) else None
    spec = parse_quant_spec(s, config)
    if wrapper is not None:          # the text tower converted, the media carried as exported
        config, spec = text_config(wrapper, s / "config.json"), tower_spec(spec)
    plan = build_plan(s, config, spec, keep_mtp=keep_mtp)
    if plan.kind == TARGET:
        config = fill_layer_pattern(config, s / "config.json")
        pattern, where = config["hybrid_override_pattern"], s / "config.json"
        try:        # the sizes the runtime builds from, against the tensors about to be written
            check_values(config, pattern, where)
            check_tensors(config, pattern, {t.name: t.shape for t in plan.tensors}, where)
        except ConfigError as e:
            raise ConversionError(f"{e}; nothing written") from None
        made = {t.name for t in plan.tensors}
        missing = [n for n in target_tensor_names(config) if n not in made]
        if missing:       # never a success message for output that would not load
            raise ConversionError(f"{src}: not a Nemotron-H checkpoint this converter knows: "
                                  f"tensor {missing[0]} missing" + (
                                      f" (and {len(missing) - 1} more)" if missing[1:] else "")
                                  + "; nothing written")
    if wrapper is not None:
        config = with_text_config(wrapper, config)
    config["quantization"] = {"layout": LAYOUT, "group_size": GROUP_SIZE,
                              "source_quant_algo": spec.algo, "modules": plan.modules}
    copies = sorted(n for n in names if "/" not in n
                    and any(fnmatch.fnmatchcase(n, p) for p in COPIED_FILES))

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-",
                                    dir=out.parent))
    except OSError as e:
        raise ConversionError(f"{out.parent}: cannot create the output there "
                              f"({e.strerror or e})") from None
    tmp.chmod(0o755)                             # mkdtemp's 0700 is for the partial state only
    pool, stop = ThreadPoolExecutor(1), threading.Event()
    files = SourceFiles()
    try:
        hashing = pool.submit(_hash_sources, s, names, check, stop)
        outputs = _write_tensors(tmp, plan.tensors, files, hashing, progress, shard_bytes)
        if plan.media:        # beside the weight files, so a text load never opens them
            outputs.update(_write_tensors(tmp, plan.media, files, hashing, progress,
                                          shard_bytes, MEDIA_STEM))
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (tmp / "config.json").write_text(text, encoding="utf-8")
        for name in copies:
            with open_regular(s / name) as f, open(tmp / name, "xb") as g:
                shutil.copyfileobj(f, g)
        for name in ["config.json", *copies]:
            size, sha = sha256_file(tmp / name)
            outputs[name] = {"size": size, "sha256": sha}
        hashed = hashing.result()
        (tmp / RECEIPT_NAME).write_text(receipt(
            version=__version__, layout=LAYOUT, kind=plan.kind, options={"keep_mtp": keep_mtp},
            repo_id=source.repo_id, revision=source.revision, source_files=hashed,
            pins=check.summary(), outputs=outputs), encoding="utf-8")
        _install(tmp, out, replacing)
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


def _write_tensors(tmp: Path, tensors, files, hashing, progress, shard_bytes,
                   stem: str = "model") -> dict:
    from tqdm import tqdm

    groups = shard(tensors, shard_bytes)
    names = ([f"{stem}.safetensors"] if len(groups) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
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
            outputs[name] = write_safetensors(tmp / name, group, METADATA, files, advance)
    finally:
        bar.close()
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: n for n, g in zip(names, groups) for t in g}}
        path = tmp / f"{stem}.safetensors.index.json"
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
    media = (f", {len(plan.media)} vision/audio tensors carried as exported into "
             f"{MEDIA_STEM}*.safetensors" if plan.media else "")
    print(f"converted {what} ({plan.kind}, {len(plan.tensors)} tensors{media}; {plan.dropped} "
          f"source tensors dropped: input/KV-cache scales, MTP) -> {out}\n{note}",
          file=sys.stderr)
