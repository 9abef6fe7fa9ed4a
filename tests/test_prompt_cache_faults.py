"""Snapshots on disk that fail closed (issue 35): a fault anywhere in a snapshot file, its
header included, is one warning, the entry dropped and the prompt prefilled cold, with the
cold run's tokens; never an exception, never a state read as absent. The directory is checked
again before each write, and its budget holds for every store that shares it.

Everything here parses in Python only (prompt_cache/snapshot_file.py reads no file through MLX), so a
hostile header cannot take the test runner down; the header sweep runs in this process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import time

import pytest

from mlx_dspark import api, cli
from mlx_dspark.cli import commands
from mlx_dspark.cli.chat import Chat
from mlx_dspark.prompt_cache.cache import PromptCache
from mlx_dspark.prompt_cache.disk import LOCK, SUFFIX, PromptStore, open_store
from mlx_dspark.prompt_cache.snapshot_file import encode
from testkit import spoil
from mlx_dspark.text.tokenizer import prompt_ids

SYSTEM = {"role": "system", "content": "You write Python for a data team. " + " ".join(
    f"def helper_{i}(rows): return [r for r in rows if r > {i}]" for i in range(20))}
QUESTION = [SYSTEM, {"role": "user", "content": "class Table:"}]


@pytest.fixture(scope="module")
def pair():
    return api.load()


@pytest.fixture(scope="module")
def cold(pair):
    """The question's greedy tokens without any cache."""
    return api.generate(pair, QUESTION, max_tokens=8, chat=True).tokens


def cached(pair, directory, warn=None, budget=10**9):
    store = open_store(directory, pair, True, budget, warn)
    return dataclasses.replace(pair, prompt_cache=PromptCache(256 << 20, store))


def system_snapshot(pair, directory) -> str:
    """Fill ``directory`` from one chat request and return the path of the system prompt's
    snapshot (the only one the question finds)."""
    first = cached(pair, directory)
    api.generate(first, [SYSTEM, {"role": "user", "content": "x"}], max_tokens=2, chat=True)
    return first.prompt_cache.store.find(prompt_ids(pair.tokenizer, QUESTION, True)).path


def assert_refused_and_cold(pair, warm, warnings, directory, cold):
    """One warning, the prompt prefilled cold with the cold tokens, a second request served
    without another warning; the cold run wrote the snapshot again, and after a restart the
    store continues from it."""
    for _ in range(2):
        got = api.generate(warm, QUESTION, max_tokens=8, chat=True)
        assert got.tokens == cold
        assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warm.prompt_cache.found["disk"] == 0
    more = []
    restarted = cached(pair, directory, more.append)
    assert api.generate(restarted, QUESTION, max_tokens=8, chat=True).tokens == cold
    assert restarted.prompt_cache.found["disk"] == 1 and not more, more


# ------------------------------------------------------------------------ crafted headers


def _header_edit(edit, reseal=False):
    def spoil_it(path):
        header, data = spoil.read_header(path)
        spoil.rewrite(path, *edit(header, data), reseal=reseal)
    return spoil_it


def _tokens_span(end, rehash):
    """The tokens' span changed to end at ``end``, their checksum recomputed over what that
    span would hold (the old store trusted both)."""
    def edit(header, data):
        header["tokens"]["data_offsets"] = [0, end]
        if rehash:
            header["__metadata__"]["tokens_sha256"] = hashlib.sha256(data[:end]).hexdigest()
        return header, data
    return _header_edit(edit)


def _deep(path):
    """A header of 100,000 nested lists (json's recursion limit)."""
    data = spoil.read_header(path)[1]
    head = b"[" * 100_000 + b"]" * 100_000
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head + data)


def _length_flip(path):
    with open(path, "r+b") as fh:
        fh.seek(5)
        byte = fh.read(1)
        fh.seek(5)
        fh.write(bytes([byte[0] ^ 0x10]))


HEADER_FAULTS = {
    # issue 35: a 500 for every request with this prefix
    "a layer's data_offsets key": spoil.renamed_key,
    # issue 35: the server did not start
    "the tokens' data_offsets key": lambda p: spoil.flip_in_header(
        p, b'"data_offsets"', 12, 0x01, after=b'"tokens"'),
    "a tensor renamed (t.3.k to t.3.j)": lambda p: spoil.flip_in_header(p, b'"t.3.k"', 5, 0x01),
    "a span past the end of the file": _tokens_span(1 << 40, rehash=False),   # MemoryError
    "a span of 131 bytes for int32 tokens": _tokens_span(131, rehash=True),   # struct.error
    "a header nested 100,000 deep": _deep,                                    # RecursionError
    "a header length past the file": _length_flip,
}


@pytest.mark.parametrize("when", ["before-start", "after-start"])
@pytest.mark.parametrize("fault", list(HEADER_FAULTS))
def test_a_fault_in_a_header_is_one_warning_and_a_cold_prefill(pair, tmp_path, cold, fault,
                                                               when):
    path = system_snapshot(pair, tmp_path)
    warnings = []
    if when == "after-start":                # spoiled while a server that indexed it runs
        warm = cached(pair, tmp_path, warnings.append)
        HEADER_FAULTS[fault](path)
    else:
        HEADER_FAULTS[fault](path)
        warm = cached(pair, tmp_path, warnings.append)
        assert path not in warm.prompt_cache.store.entries      # dropped by the scan
    assert_refused_and_cold(pair, warm, warnings, tmp_path, cold)


def _drop(name):
    """Leave tensor ``name`` out of the header and the data."""
    def edit(header, data):
        start, end = header.pop(name)["data_offsets"]
        for spec in header.values():
            span = spec.get("data_offsets")
            if span and span[0] >= end:
                spec["data_offsets"] = [span[0] - (end - start), span[1] - (end - start)]
        return header, data[:start] + data[end:]
    return edit


def _respec(name, **spec):
    def edit(header, data):
        header[name].update(spec)
        return header, data
    return edit


def _layout(**change):
    def edit(header, data):
        meta = header["__metadata__"]
        meta["layout"] = json.dumps(dict(json.loads(meta["layout"]), **change))
        return header, data
    return edit


def _extra_tensor(header, data):
    header["t.1.ssm"] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data),
                                                                        len(data) + 4]}
    return header, data + bytes(4)


def _flat_keys(header, data):
    shape = header["t.3.k"]["shape"]
    return _respec("t.3.k", shape=[1, 1, 2 * shape[2], shape[3]])(header, data)


# Written by a faulty (or hostile) writer of this format, checksums and all: only the checks
# of what the layout and the layer pattern imply can refuse them.
RESEALED = {
    "a state left out": (_drop("t.0.ssm"), "its tensor t.0.ssm is missing"),
    "an SSM state stored as int32": (_respec("t.0.ssm", dtype="I32"), "is I32"),
    "a tensor the layout has no place for": (_extra_tensor, "no place for"),
    "keys of twice the positions": (_flat_keys, "hold"),
    "a layer missing from the layout": (_layout(layers=["mamba", None, "mamba", "kv",
                                                        None]), "layers are not this"),
    "queued taps of other tokens": (_layout(pending_start=3), "taps"),
}


@pytest.mark.parametrize("fault", list(RESEALED))
def test_a_sealed_snapshot_that_is_not_this_models_state_is_refused(pair, tmp_path, cold,
                                                                    fault):
    path = system_snapshot(pair, tmp_path)
    edit, reason = RESEALED[fault]
    _header_edit(edit, reseal=True)(path)
    warnings = []
    warm = cached(pair, tmp_path, warnings.append)
    assert_refused_and_cold(pair, warm, warnings, tmp_path, cold)
    assert reason in warnings[0], warnings


# ---------------------------------------------------------------------------- bit flips


def test_single_bit_flips_of_a_header_are_refused_or_harmless(pair, tmp_path, cold):
    """Every single-bit flip of a real snapshot's header and its length field, one at a time
    (about 15,000 variants): the variant is refused with one warning and its entry dropped,
    or it loads and continues as the cold run does. (Issue 35's sweep found 248 flips that
    changed the greedy output and 4,067 that raised KeyError.)"""
    path = system_snapshot(pair, tmp_path)
    for name in os.listdir(tmp_path):       # the question's snapshot alone
        if name.endswith(SUFFIX) and str(tmp_path / name) != path:
            os.unlink(tmp_path / name)
    ident = json.loads(spoil.read_header(path)[0]["__metadata__"]["identity"])
    ids = prompt_ids(pair.tokenizer, QUESTION, True)
    session = pair.session()
    refused = loaded = 0
    t0 = time.perf_counter()
    with open(path, "r+b") as fh:
        original = fh.read()
        (n,) = struct.unpack("<Q", original[:8])
        for at in range(8 + n):
            for bit in range(8):
                fh.seek(at)             # flipped in place, and back: the data stays put
                fh.write(bytes([original[at] ^ (1 << bit)]))
                fh.flush()
                warnings = []
                store = PromptStore(tmp_path, ident, 10**9, warnings.append)
                if PromptCache(0, store).start(session, ids):
                    got = api.generate(pair, ids, max_tokens=8, session=session)
                    assert got.tokens == cold and not warnings, (at, bit)
                    loaded += 1
                else:
                    assert len(warnings) == 1 and path not in store.entries, \
                        (at, bit, warnings)
                    refused += 1
                fh.seek(at)
                fh.write(original[at:at + 1])
                fh.flush()
    assert refused + loaded == 8 * (8 + n) > 10_000
    assert time.perf_counter() - t0 < 60        # about 15 s on a loaded 2-core machine


# ------------------------------------------------------------------------ the directory


def test_a_directory_swapped_for_a_symlink_after_start_is_never_written_through(
        pair, tmp_path):
    d, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    warnings = []
    warm = cached(pair, d, warnings.append)
    os.rename(d, tmp_path / "moved")
    os.symlink(elsewhere, d)
    api.generate(warm, QUESTION, max_tokens=2, chat=True)
    assert os.listdir(elsewhere) == []
    assert len(warnings) == 1 and "is not a directory (a symlink" in warnings[0], warnings


def test_a_directory_others_may_write_is_refused_at_start_and_before_each_write(
        pair, tmp_path):
    warnings = []
    warm = cached(pair, tmp_path, warnings.append)
    os.chmod(tmp_path, 0o777)
    api.generate(warm, QUESTION, max_tokens=2, chat=True)
    assert [n for n in os.listdir(tmp_path) if n.endswith(SUFFIX)] == []
    assert len(warnings) == 1 and "can be written by other users" in warnings[0], warnings
    with pytest.raises(OSError, match="can be written by other users .mode 777"):
        cached(pair, tmp_path)


def _snapshots(pair, n):
    out = []
    for i in range(n):
        session = pair.session()
        api.generate(pair, [i + 3] * 40, max_tokens=2, session=session)
        out.append(session.snapshot())
    return out


def _dir_bytes(d):
    return sum(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(SUFFIX))


def test_two_stores_sharing_a_directory_keep_its_budget_and_the_newest_files(pair, tmp_path):
    """Two servers on one directory: each counts every snapshot file there, and evicts the
    least recently used whoever wrote it (the old stores each counted their own files, and
    the directory held twice the budget)."""
    snaps = _snapshots(pair, 8)           # alike in size: 42 tokens each
    size = encode(snaps[0], open_store(tmp_path / "probe", pair, True, 0).ident, "").size
    a, b = (open_store(tmp_path, pair, True, int(3.5 * size)) for _ in range(2))
    written = []
    for i, snap in enumerate(snaps):
        store = (a, b)[i % 2]
        assert store.add(snap)
        written.append(store._name(snap.tokens, ""))
        assert _dir_bytes(tmp_path) <= a.budget
        # the order of use, set rather than slept for: a file system's clock may not tell
        # writes a few milliseconds apart (and the clock may step back)
        os.utime(tmp_path / written[-1], ns=((i + 1) * 10**9,) * 2)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(SUFFIX)) == \
        sorted(written[-3:])


WRITER = """
import sys
from mlx_dspark import api
from mlx_dspark.prompt_cache.disk import open_store
pair = api.load()
store = open_store(sys.argv[1], pair, True, int(sys.argv[2]))
for i in range(12):
    session = pair.session()
    api.generate(pair, [int(sys.argv[3]) + i] * 40, max_tokens=2, session=session)
    store.add(session.snapshot())
"""


@pytest.mark.slow
def test_two_processes_writing_to_one_directory_keep_its_budget(pair, tmp_path):
    size = encode(_snapshots(pair, 1)[0], open_store(tmp_path / "probe", pair, True, 0).ident,
                  "").size
    d, budget = tmp_path / "cache", int(3.5 * size)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(budget), str(k)])
               for k in (3, 40)]
    most = 0
    while any(w.poll() is None for w in writers):
        try:
            most = max(most, _dir_bytes(d))
        except FileNotFoundError:           # evicted between the listing and the size
            pass
        time.sleep(0.005)
    assert [w.returncode for w in writers] == [0, 0]
    assert 0 < most <= budget and _dir_bytes(d) <= budget


def test_a_lock_file_is_all_a_store_adds_beside_its_snapshots(pair, tmp_path):
    store = open_store(tmp_path, pair, True, 10**9)
    store.add(_snapshots(pair, 1)[0])
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(SUFFIX)) == \
        sorted([LOCK, "named"])


# ------------------------------------------------------------------------------- chat


def chat(pair, tmp_path, lines, *flags, monkeypatch, capsys):
    """Run ``mlx-dspark chat --prompt-cache-dir tmp_path`` in this process on ``lines``;
    (exit code, stderr, the conversation's messages)."""
    args = cli.build_parser().parse_args(["chat", "--prompt-cache-dir", str(tmp_path),
                                          "-m", "6", *flags])
    p = dataclasses.replace(pair, prompt_cache=None)
    commands.with_prompt_cache(p, args)
    feed = iter(lines)

    def read(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", read)
    capsys.readouterr()
    session = Chat(p, args)
    code = session.run()
    return code, capsys.readouterr().err, session.conversation.messages


def test_chat_resume_of_a_spoiled_snapshot_warns_once_and_starts_fresh(pair, tmp_path,
                                                                       monkeypatch, capsys):
    kw = dict(monkeypatch=monkeypatch, capsys=capsys)
    chat(pair, tmp_path, ["def parse(line):", "/save mine"], **kw)
    spoil.renamed_key(str(tmp_path / "named" / ("mine" + SUFFIX)))
    code, err, messages = chat(pair, tmp_path, ["class A:"], "--resume", "mine", **kw)
    assert code == 0
    assert err.count("warning:") == 1 and "--resume mine" in err and \
        "starting a new conversation" in err, err
    assert messages == chat(pair, tmp_path, ["class A:"], **kw)[2] and len(messages) == 2


def test_chat_load_of_a_spoiled_snapshot_keeps_the_conversation(pair, tmp_path, monkeypatch,
                                                                capsys):
    kw = dict(monkeypatch=monkeypatch, capsys=capsys)
    chat(pair, tmp_path, ["import os", "/save mine"], **kw)
    spoil.renamed_tensor(str(tmp_path / "named" / ("mine" + SUFFIX)))
    turns = ["def parse(line):", "class A:"]
    code, err, messages = chat(pair, tmp_path, [turns[0], "/load mine", turns[1]], **kw)
    assert code == 0 and err.count("warning:") == 1 and "/load mine" in err, err
    assert messages == chat(pair, tmp_path, turns, **kw)[2] and len(messages) == 4
