"""Hostile and careless input to ``mlx-dspark convert`` (issue 11): convert never destroys
what it did not make, and reads SRC as data, never following it. Each test is one class of
problem; each asserts what the user sees (one line naming the file and the problem, a
non-zero exit, OUT untouched, nothing left beside it)."""

import errno
import hashlib
import importlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from testkit.synthetic import synth_drafter, synth_target
from mlx_dspark.cli import main
from mlx_dspark.converter.convert import RECEIPT_NAME

CONVERT = importlib.import_module("mlx_dspark.converter.convert")
M = "backbone.layers.0.mixer.in_proj"           # an NVFP4 module of the synthetic target
FP8 = "backbone.layers.0.mixer.in_proj"         # the same module in an FP8 source
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    rc = main(["convert", *map(str, argv), "--no-progress"])
    return rc, capsys.readouterr().err.strip().splitlines()


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def assert_one_line(rc, lines, *words):
    assert rc == 1, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("mlx-dspark convert: error: "), lines[0]
    for w in words:
        assert str(w) in lines[0], lines[0]


def tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file()}


def converted(tmp_path, capsys) -> tuple[Path, Path]:
    src, out = tmp_path / "src", tmp_path / "out"
    synth_target(src)
    assert main(["convert", str(src), "-o", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    return src, out


# ------------------------------------------------------------ item 1: never destroy


@pytest.mark.parametrize("layout", ["repository copy", "folder of the user's files",
                                    "receipt whose outputs are a list"])
def test_force_refuses_a_directory_that_merely_holds_a_receipt_named_file(layout, tmp_path,
                                                                         capsys):
    synth_target(tmp_path / "src")
    out = tmp_path / "mine"
    out.mkdir()
    if layout == "repository copy":          # the repo's pin file has the receipt's name
        (out / RECEIPT_NAME).write_text('{"format": "mlx-dspark-pins/1", "sources": {}}')
        (out / "README.md").write_text("my repo")
    elif layout == "folder of the user's files":
        (out / RECEIPT_NAME).write_text("not even JSON")
        (out / "thesis.tex").write_text("three years of work")
    else:
        (out / RECEIPT_NAME).write_text('{"format": "mlx-dspark-receipt/1", "outputs": []}')
        (out / "model.safetensors").write_text("someone else's weights")
    before = tree(out)
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", out, "--force")
    assert_one_line(rc, lines, out, "refusing to replace: not a converted checkpoint")
    assert tree(out) == before
    assert leftovers(out) == []


def test_force_refuses_a_conversion_with_files_its_receipt_does_not_list(tmp_path, capsys):
    src, out = converted(tmp_path, capsys)
    (out / "notes.txt").write_text("added by the user")
    before = tree(out)
    rc, lines = run_cli(capsys, src, "-o", out, "--force")
    assert_one_line(rc, lines, out, "'notes.txt' is not listed in its " + RECEIPT_NAME)
    assert tree(out) == before


def test_force_refuses_an_out_that_contains_src(tmp_path, capsys):
    src = tmp_path / "work" / "src"
    synth_target(src)
    (tmp_path / "work" / RECEIPT_NAME).write_text("{}")    # enough for main's old check
    before = tree(tmp_path / "work")
    rc, lines = run_cli(capsys, src, "-o", tmp_path / "work", "--force")
    assert_one_line(rc, lines, tmp_path / "work", "a directory that contains it")
    assert tree(tmp_path / "work") == before


def test_force_refuses_a_symlinked_out(tmp_path, capsys):
    src, out = converted(tmp_path, capsys)
    link = tmp_path / "link"
    link.symlink_to(out)
    rc, lines = run_cli(capsys, src, "-o", link, "--force")
    assert_one_line(rc, lines, link, "not a directory of its own")
    assert link.is_symlink() and os.readlink(link) == str(out)


def test_out_that_appears_during_conversion_is_never_replaced(tmp_path, capsys, monkeypatch):
    synth_target(tmp_path / "src")
    out = tmp_path / "out"
    write = CONVERT._write_tensors

    def racing_run(tmp, *args):              # another process creates OUT meanwhile
        out.mkdir()
        (out / "theirs.txt").write_text("another run's result")
        return write(tmp, *args)

    monkeypatch.setattr(CONVERT, "_write_tensors", racing_run)
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", out)
    assert_one_line(rc, lines, out, "appeared while converting; left untouched")
    assert tree(out) == {"theirs.txt": b"another run's result"}
    assert leftovers(out) == []


def test_empty_out_that_appears_during_conversion_is_not_replaced(tmp_path, capsys,
                                                                   monkeypatch):
    # rename(2) silently replaces an empty directory: the decision "OUT did not exist" must
    # still hold at the end
    synth_target(tmp_path / "src")
    out = tmp_path / "out"
    write = CONVERT._write_tensors
    monkeypatch.setattr(CONVERT, "_write_tensors", lambda tmp, *a: (out.mkdir(), write(tmp, *a))[1])
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", out)
    assert_one_line(rc, lines, out, "appeared while converting")
    assert list(out.iterdir()) == [] and leftovers(out) == []


def test_force_keeps_an_out_that_changed_during_conversion(tmp_path, capsys, monkeypatch):
    src, out = converted(tmp_path, capsys)
    write = CONVERT._write_tensors

    def user_saves_into_out(tmp, *args):
        (out / "results.csv").write_text("saved meanwhile")
        return write(tmp, *args)

    monkeypatch.setattr(CONVERT, "_write_tensors", user_saves_into_out)
    rc, lines = run_cli(capsys, src, "-o", out, "--force")
    assert_one_line(rc, lines, out, "changed while converting ('results.csv' is not listed")
    assert (out / "results.csv").read_text() == "saved meanwhile"
    assert (out / RECEIPT_NAME).is_file() and leftovers(out) == []


def test_force_fills_an_empty_directory(tmp_path, capsys):
    synth_target(tmp_path / "src")
    (tmp_path / "out").mkdir()
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out", "--force")
    assert rc == 0, lines
    assert (tmp_path / "out" / RECEIPT_NAME).is_file()


_SELF_SIGNAL = """
import os, signal, sys
from mlx_dspark.converter import convert as _
conv = sys.modules["mlx_dspark.converter.convert"]
write = conv._write_tensors
def killed_midway(tmp, *args):
    (tmp / "half.bin").write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.{sig})
    return write(tmp, *args)
conv._write_tensors = killed_midway
from mlx_dspark.cli import main
sys.exit(main(["convert", sys.argv[1], "-o", sys.argv[2], "--no-progress"]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_termination_signals_clean_up_like_ctrl_c(sig, tmp_path):
    synth_target(tmp_path / "src")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", _SELF_SIGNAL.replace("{sig}", sig),
                        str(tmp_path / "src"), str(out)], capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert r.stderr.strip() == "mlx-dspark convert: interrupted"
    assert not out.exists() and leftovers(out) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_partial_left_by_a_killed_run_is_removed_by_the_next_run(tmp_path, capsys):
    synth_target(tmp_path / "src")
    out = tmp_path / "out"
    dead = tmp_path / f".out.partial-{_dead_pid()}-k1ll3d"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half a tensor")
    live = tmp_path / f".out.partial-{os.getpid()}-al1ve0"     # a run still going: untouched
    live.mkdir()
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", out)
    assert rc == 0, lines
    assert leftovers(out) == [live.name]
    assert (out / RECEIPT_NAME).is_file()


def test_conversion_moved_aside_by_a_killed_force_run_is_put_back(tmp_path, capsys):
    src, out = converted(tmp_path, capsys)
    before = tree(out)
    aside = tmp_path / f".out.old-{_dead_pid()}-s4v3d0"
    aside.mkdir()
    out.rename(aside / "out")                 # killed between the two renames of --force
    rc, lines = run_cli(capsys, src, "-o", out)
    assert_one_line(rc, lines, out, "already exists")           # it is back, so not replaced
    assert tree(out) == before and leftovers(out) == []


_TRUNCATE_WHILE_READING = """
import hashlib, os, sys
from mlx_dspark.converter import safetensors_io as io
io.CHUNK_BYTES = 1 << 20                  # several reads per tensor, as on a real checkpoint
real, victim, done = hashlib.sha256, sys.argv[1], []
class TruncatingSha:                      # the source is truncated while its bytes are in use
    def __init__(self): self.h = real()
    def update(self, b):
        if not done and len(b) >= 1 << 20:
            done.append(os.truncate(victim, 4096))
        self.h.update(b)
    def hexdigest(self): return self.h.hexdigest()
hashlib.sha256 = TruncatingSha
from mlx_dspark.cli import main
sys.exit(main(["convert", sys.argv[2], "-o", sys.argv[3], "--no-progress"]))
"""


def test_source_truncated_while_converting_is_a_clean_error_not_sigbus(tmp_path):
    big = np.arange(2 << 20, dtype=np.float32)                     # 8 MiB
    synth_target(tmp_path / "src", edit=lambda t, c, q: t.__setitem__(
        "backbone.layers.0.mixer.big_table", ("F32", big.shape, big.tobytes())))
    out = tmp_path / "out"
    victim = tmp_path / "src" / "model.safetensors"
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_WHILE_READING, str(victim),
                        str(tmp_path / "src"), str(out)], capture_output=True, text=True,
                       env=ENV, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert_one_line(r.returncode, lines, victim, "file shrank while converting")
    assert not out.exists() and leftovers(out) == []


@pytest.mark.parametrize("where", ["parent is a file", "read-only parent"])
def test_unwritable_out_parent_is_one_line(where, tmp_path, capsys):
    synth_target(tmp_path / "src")
    if where == "parent is a file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
    elif os.geteuid() == 0:
        # root writes through a 0o555 directory; sysfs refuses new directories even to root
        out = Path("/sys") / f"mlx-dspark-test-{os.getpid()}"
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        out = tmp_path / "ro" / "out"
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", out)
    assert_one_line(rc, lines, out.parent, "cannot create the output there")


# ------------------------------------------------------------ item 2: SRC is data


def test_symlink_out_of_src_is_refused_by_name(tmp_path, capsys):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$hash")
    src, out = tmp_path / "src", tmp_path / "out"
    synth_target(src)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    rc, lines = run_cli(capsys, src, "-o", out)
    assert_one_line(rc, lines, src / "tokenizer.json", "outside SRC")
    assert not out.exists() and leftovers(out) == []


def test_symlinks_inside_src_and_hf_cache_blob_links_are_followed(tmp_path, capsys):
    """The real Hugging Face cache: snapshot files are links into the repo's blobs/."""
    plain = tmp_path / "plain"
    synth_target(plain)
    repo = tmp_path / "cache" / "models--test-org--tiny"
    snap, blobs = repo / "snapshots" / ("0" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in plain.iterdir():
        (blobs / p.name).write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(Path("../../blobs") / p.name)
    (snap / "tokenizer_config.json").unlink()
    (snap / "tokenizer_config.json").symlink_to("generation_config.json")  # inside SRC
    rc, lines = run_cli(capsys, snap, "-o", tmp_path / "out")
    assert rc == 0, lines
    copied = tmp_path / "out" / "tokenizer_config.json"
    assert copied.read_bytes() == (plain / "generation_config.json").read_bytes()
    assert not copied.is_symlink()


@pytest.mark.parametrize("kind", ["directory cycle", "file cycle", "dangling"])
def test_symlink_cycles_and_dangling_links_are_refused_without_looping(kind, tmp_path, capsys):
    src = tmp_path / "src"
    synth_target(src)
    if kind == "directory cycle":
        (src / "sub").mkdir()
        (src / "sub" / "loop").symlink_to("..")
        bad = f"{src / 'sub' / 'loop'}: symbolic link to a directory (never followed)"
    elif kind == "file cycle":
        (src / "a.json").symlink_to("b.json")
        (src / "b.json").symlink_to("a.json")
        bad = f"{src / 'a.json'}: dangling or cyclic symbolic link"
    else:
        (src / "gone.json").symlink_to("nowhere.json")
        bad = f"{src / 'gone.json'}: dangling or cyclic symbolic link"
    t = time.monotonic()
    rc, lines = run_cli(capsys, src, "-o", tmp_path / "out")
    assert time.monotonic() - t < 30
    assert_one_line(rc, lines, bad)
    assert not (tmp_path / "out").exists()


_CONVERT_CLI = [sys.executable, "-m", "mlx_dspark.cli", "convert"]


@pytest.mark.parametrize("where", ["in SRC", "as --pins"])
def test_fifo_is_refused_by_name_instead_of_hanging(where, tmp_path):
    src = tmp_path / "src"
    synth_target(src)
    fifo = src / "notes.txt" if where == "in SRC" else tmp_path / "pins.json"
    os.mkfifo(fifo)
    extra = ["--pins", str(fifo)] if where == "as --pins" else []
    r = subprocess.run([*_CONVERT_CLI, str(src), "-o", str(tmp_path / "out"), "--no-progress",
                        *extra], capture_output=True, text=True, env=ENV, timeout=60)
    assert_one_line(r.returncode, r.stderr.strip().splitlines(), fifo, "not a regular file")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------ parsing: types, depth, size


def _index_value(value):
    def post(src):
        p = src / "model.safetensors.index.json"
        doc = json.loads(p.read_text())
        doc["weight_map"][next(iter(doc["weight_map"]))] = value
        p.write_text(json.dumps(doc))
    return post


def _config(**changes):
    def post(src):
        c = json.loads((src / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
        (src / "config.json").write_text(json.dumps(c))
    return post


def _quant(**changes):
    def post(src):
        p = src / "hf_quant_config.json"
        doc = json.loads(p.read_text())
        doc["quantization"].update(changes)
        p.write_text(json.dumps(doc))
    return post


def _quant_algo_list(src):                    # the same list in both files: no contradiction
    _quant(quant_algo=["NVFP4"])(src)
    c = json.loads((src / "config.json").read_text())
    c["quantization_config"]["quant_algo"] = ["NVFP4"]
    (src / "config.json").write_text(json.dumps(c))


def _config_is_a_list(src):
    (src / "config.json").write_text("[1, 2, 3]")


# id -> (algo, shards, change to the written source, file named, words)
MALFORMED = {
    "config.json is a list": ("W4A16_NVFP4", 1, _config_is_a_list, "config.json",
                              "not a JSON object"),
    "architectures is a number": ("W4A16_NVFP4", 1, _config(architectures=7), "config.json",
                                  "architectures must be a list"),
    "pattern is a number": ("W4A16_NVFP4", 1,
                            _config(layers_block_type=None, hybrid_override_pattern=5),
                            "config.json", "hybrid_override_pattern must be a string"),
    "quant_algo is a list": ("W4A16_NVFP4", 1, _quant_algo_list, "hf_quant_config.json",
                             "unsupported quant_algo ['NVFP4']"),
    "quantized_layers is a list": ("MIXED_PRECISION", 1, _quant(quantized_layers=[M]),
                                   "hf_quant_config.json", "quantized_layers must be an object"),
    "exclude_modules is a string": ("W4A16_NVFP4", 1, _quant(exclude_modules="lm_head"),
                                    "hf_quant_config.json", "exclude_modules must be a list"),
    "index maps a tensor to a number": ("W4A16_NVFP4", 2, _index_value(3),
                                        "model.safetensors.index.json", "is not a file name"),
    "index maps a tensor to a list": ("W4A16_NVFP4", 2, _index_value(["a"]),
                                      "model.safetensors.index.json", "is not a file name"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_json_types_are_one_line(case, tmp_path, capsys):
    algo, shards, post, fname, words = MALFORMED[case]
    synth_target(tmp_path / "src", algo, shards=shards)
    post(tmp_path / "src")
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out")
    assert_one_line(rc, lines, fname, words)
    assert not (tmp_path / "out").exists()


def test_malformed_pin_file_is_one_line(tmp_path, capsys):
    synth_target(tmp_path / "src")
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({"format": "mlx-dspark-pins/1", "sources": {
        "org/m": {"revision": "r", "files": {"config.json": "abc"}}}}))
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out", "--pins", pins,
                        "--repo-id", "org/m")
    assert_one_line(rc, lines, pins, "files['config.json'] must be")


def _nested_header(src):
    raw = b"[" * 200_000 + b"]" * 200_000
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def _nested_config(src):
    (src / "config.json").write_text('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")


@pytest.mark.parametrize("post,fname", [(_nested_header, "model.safetensors"),
                                        (_nested_config, "config.json")])
def test_deeply_nested_json_is_one_line_not_recursion_error(post, fname, tmp_path, capsys):
    synth_target(tmp_path / "src")
    post(tmp_path / "src")
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out")
    assert_one_line(rc, lines, fname, "nested too deeply")


_DUPLICATE_AMONG_MANY = """
import json, struct, sys, time
from pathlib import Path
from mlx_dspark.converter.safetensors_io import read_header
from mlx_dspark.converter.errors import ConversionError
n = 200_000
entries = [f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n)]
entries.append(f'"t{n - 1}":{{"dtype":"U8","shape":[1],"data_offsets":[{n},{n + 1}]}}')
raw = ("{" + ",".join(entries) + "}").encode()
p = Path(sys.argv[1])
p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(n + 1))
try:
    read_header(p)
except ConversionError as e:
    print(e)
"""


def test_duplicate_name_among_200k_tensors_is_found_in_linear_time(tmp_path):
    # the duplicate check used to count each name in the whole list: 4e10 steps here
    path = tmp_path / "many.safetensors"
    r = subprocess.run([sys.executable, "-c", _DUPLICATE_AMONG_MANY, str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"{path}: corrupt safetensors header (duplicate key 't199999')"


def _rename_expert(old: str, new: str):
    def edit(t, c, q):
        for s in ("weight", "weight_scale", "weight_scale_2"):
            for p in ("up_proj", "down_proj"):
                t[f"backbone.layers.1.mixer.experts.{new}.{p}.{s}"] = t.pop(
                    f"backbone.layers.1.mixer.experts.{old}.{p}.{s}")
    return edit


@pytest.mark.parametrize("index,words", [
    ("1000000000", "not a plain number below 10^9"),
    ("9" * 5000, "not a plain number below 10^9"),
    ("7", "expert index 7 but config.json says there are 4"),
    ("03", "not a plain number"),
])
def test_expert_index_is_checked_before_anything_is_allocated(index, words, tmp_path, capsys):
    synth_target(tmp_path / "src", edit=_rename_expert("3", index))
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out")
    assert_one_line(rc, lines, "model.safetensors", words)


def _f32(v):
    return ("F32", (), np.float32(v).tobytes())


@pytest.mark.parametrize("algo,name,value,words", [
    ("W4A16_NVFP4", f"{M}.weight_scale_2", _f32(np.nan), "is nan"),
    ("W4A16_NVFP4", f"{M}.weight_scale_2", _f32(np.inf), "is inf"),
    ("W4A16_NVFP4", f"{M}.weight_scale_2", _f32(0.0), "is 0.0"),
    ("W4A16_NVFP4", f"{M}.weight_scale_2", _f32(-0.5), "is -0.5"),
    ("FP8", f"{FP8}.weight_scale", _f32(np.nan), "FP8 weight_scale is nan"),
    ("W4A16_NVFP4", f"{M}.weight_scale", ("F8_E4M3", (196, 4), bytes(100) + b"\x7f" + bytes(683)),
     "block scale byte 100 is 0x7F"),
    ("W4A16_NVFP4", f"{M}.weight_scale", ("F8_E4M3", (196, 4), b"\xb8" + bytes(783)),
     "block scale byte 0 is 0xB8"),
])
def test_nonfinite_or_nonpositive_scales_are_refused_at_convert_time(algo, name, value, words,
                                                                    tmp_path, capsys):
    synth_target(tmp_path / "src", algo, edit=lambda t, c, q: t.__setitem__(name, value))
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out")
    assert_one_line(rc, lines, "model.safetensors", name, words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind,key,value,words", [
    ("target", "hidden_size", 10 ** 12, "hidden_size 1000000000000 contradicts tensor "
                                        "'backbone.embeddings.weight' of shape [128, 64]"),
    ("target", "vocab_size", 100, "vocab_size 100 contradicts"),
    ("target", "moe_intermediate_size", 48, "moe_intermediate_size 48 contradicts"),
    ("target", "n_routed_experts", 3, "expert index 3 but config.json says there are 3"),
    ("target", "n_routed_experts", 6, "not numbered 0..E-1 (missing [4, 5])"),
    ("target", "n_routed_experts", 10 ** 12, "not numbered 0..E-1 (missing [4, 5, 6, 7, 8])"),
    ("target", "hidden_size", "64", "hidden_size must be a positive integer, got '64'"),
    ("drafter", "intermediate_size", 10 ** 12, "intermediate_size 1000000000000 contradicts"),
    ("drafter", "num_hidden_layers", 1, "layer index 1 but config.json says there are 1"),
])
def test_config_sizes_contradicting_the_tensors_are_refused(kind, key, value, words, tmp_path,
                                                           capsys):
    edit = lambda t, c, q: c.update({key: value})             # noqa: E731
    (synth_target if kind == "target" else synth_drafter)(tmp_path / "src", edit=edit)
    rc, lines = run_cli(capsys, tmp_path / "src", "-o", tmp_path / "out")
    assert_one_line(rc, lines, words)
    assert not (tmp_path / "out").exists()


def test_conversion_is_byte_identical_where_the_kernel_cannot_copy_files(tmp_path,
                                                                        monkeypatch):
    """macOS has no file-to-file sendfile: the buffered path must write the same bytes."""
    big = np.arange(3 << 20, dtype=np.float32)                     # 12 MiB: several chunks
    synth_target(tmp_path / "src", edit=lambda t, c, q: t.__setitem__(
        "backbone.layers.0.mixer.big_table", ("F32", big.shape, big.tobytes())))
    io = importlib.import_module("mlx_dspark.converter.safetensors_io")
    monkeypatch.setattr(io, "CHUNK_BYTES", 5 << 20)
    CONVERT.convert(str(tmp_path / "src"), tmp_path / "kernel", progress=False)

    refused = []

    def no_file_sendfile(*args):
        refused.append(args)
        raise OSError(errno.ENOTSOCK, os.strerror(errno.ENOTSOCK))

    monkeypatch.setattr(io.os, "sendfile", no_file_sendfile)
    CONVERT.convert(str(tmp_path / "src"), tmp_path / "buffered", progress=False)
    assert refused                                    # the buffered path really ran
    assert tree(tmp_path / "buffered") == tree(tmp_path / "kernel")
    receipt = json.loads((tmp_path / "kernel" / RECEIPT_NAME).read_text())
    for name, entry in receipt["outputs"].items():
        assert hashlib.sha256((tmp_path / "kernel" / name).read_bytes()).hexdigest() == \
            entry["sha256"]
