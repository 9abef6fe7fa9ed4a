"""Converter throughput and memory on a synthetic ModelOpt-layout checkpoint (>= 2 GB).

Throughput is reported as a ratio to a plain file copy of the same source bytes, measured in
the same run on the same disk (both read the source from the page cache). Peak resident
memory of the converter process is compared with the largest tensor it writes, and with the
peak of the same command on a tiny checkpoint (the fixed overhead: interpreter + imports).
Goal (issue 2): >= 0.5x copy speed; peak <= 2x largest tensor + fixed overhead.

    /work/venv/bin/python benchmarks/bench_convert.py [--gb 2.2] [--repeat 3] [--dir /tmp]

The checkpoint holds random bytes in valid ModelOpt shapes and dtypes (block scales drawn from
the finite non-negative E4M3 bytes, which the converter checks; every other value it copies
without looking). Everything generated is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HIDDEN, VOCAB, EXPERT_INTER = 2688, 131072, 1856      # the real Lightning target's sizes


DTYPE_BYTES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def _nvfp4(specs, prefix, out, inp):
    specs[f"{prefix}.weight"] = ("U8", (out, inp // 2))
    specs[f"{prefix}.weight_scale"] = ("F8_E4M3", (out, inp // 16))
    specs[f"{prefix}.weight_scale_2"] = ("F32", ())


def _write_shard(path: Path, specs: dict, rng) -> None:
    """Header first, then random bytes generated 64 MB at a time, so this process stays
    small (a child's peak-RSS figure starts from its parent's size at fork)."""
    header, off = {}, 0
    for name, (dtype, shape) in specs.items():
        n = int(np.prod(shape)) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, (dtype, shape) in specs.items():
            if dtype == "F32" and shape == ():
                f.write(np.float32(1e-3).tobytes())
                continue
            left = int(np.prod(shape)) * DTYPE_BYTES[dtype]
            while left:
                chunk = rng.bytes(min(left, 64 << 20))
                if dtype == "F8_E4M3":           # 0x7F/0xFF are NaN, the sign bit negative
                    chunk = (np.frombuffer(chunk, np.uint8) % 0x7F).astype(np.uint8).tobytes()
                f.write(chunk)
                left -= len(chunk)


def make_source(path: Path, gb: float, seed=0) -> int:
    """A Nemotron-H-shaped W4A16_NVFP4 export of about ``gb`` GB in two shards; returns the
    largest output tensor's size in bytes."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    per_layer = 2 * EXPERT_INTER * HIDDEN * (1 / 2 + 1 / 16)
    fixed = 2 * VOCAB * HIDDEN * 2
    experts = 128
    layers = max(1, round((gb * 1e9 - fixed) / (experts * per_layer)))
    shards, weight_map, largest = [{}, {}], {}, 0
    for i in range(layers + 1):
        t = shards[i % 2]
        if i == layers:                          # a Mamba layer ends the stack
            _nvfp4(t, f"backbone.layers.{i}.mixer.in_proj", 2 * 4096 + 2 * 8 * 128 + 64, HIDDEN)
            _nvfp4(t, f"backbone.layers.{i}.mixer.out_proj", HIDDEN, 4096)
            continue
        for e in range(experts):
            _nvfp4(t, f"backbone.layers.{i}.mixer.experts.{e}.up_proj", EXPERT_INTER, HIDDEN)
            _nvfp4(t, f"backbone.layers.{i}.mixer.experts.{e}.down_proj", HIDDEN, EXPERT_INTER)
        largest = max(largest, experts * EXPERT_INTER * HIDDEN // 2)
        t[f"backbone.layers.{i}.mixer.gate.weight"] = ("F32", (experts, HIDDEN))
    shards[0]["backbone.embeddings.weight"] = ("BF16", (VOCAB, HIDDEN))
    shards[1]["lm_head.weight"] = ("BF16", (VOCAB, HIDDEN))
    largest = max(largest, VOCAB * HIDDEN * 2)
    for k, t in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        _write_shard(path / name, t, rng)
        weight_map.update({n: name for n in t})
    pattern = "".join("E" if i < layers else "M" for i in range(layers + 1))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["NemotronHForCausalLM"], "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    return largest


# Peak RSS is read from the child's own /proc/self/status (VmHWM): getrusage's ru_maxrss of a
# child also counts its parent's memory at fork, which would charge this script's size to it.
REPORT_HWM = ("\nimport sys\nkb = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]"
              "\nprint(kb, file=sys.stdout)")
CONVERT = "import sys\nfrom mlx_dspark.cli import main\nrc = main(sys.argv[1:])" + REPORT_HWM + \
    "\nsys.exit(rc)"
HASH = ("import hashlib, sys, pathlib\n"
        "for p in sorted(pathlib.Path(sys.argv[1]).iterdir()):\n"
        "    h = hashlib.sha256()\n"
        "    with open(p, 'rb') as f:\n"
        "        while b := f.read(64 << 20): h.update(b)" + REPORT_HWM)
COPY = ("import shutil, sys, pathlib\nd = pathlib.Path(sys.argv[2]); d.mkdir()\n"
        "for p in pathlib.Path(sys.argv[1]).iterdir(): shutil.copyfile(p, d / p.name)" + REPORT_HWM)


def run_child(code: str, *args: str) -> tuple[float, int, float]:
    """Wall time, peak RSS (bytes) and CPU seconds of ``python -c code args``, started after
    a sync so that no earlier run's writeback is charged to it."""
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        sys.exit(f"child failed: {args}\n{err}")
    return wall, int(out.split()[-1]) * 1024, cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir))
    py = sys.executable
    try:
        src = root / "src"
        largest = make_source(src, args.gb)
        src_bytes = sum(p.stat().st_size for p in src.iterdir())
        tiny = root / "tiny"
        make_tiny = [py, "-c", "import sys; from testkit.synthetic import synth_target;"
                     "synth_target(sys.argv[1])", str(tiny)]
        subprocess.run(make_tiny, check=True, cwd=Path(__file__).resolve().parents[1])
        _, overhead, _ = run_child(CONVERT, "convert", str(tiny), "-o", str(root / "tiny-out"),
                                   "--no-progress")
        # One SHA-256 pass over the source: the converter must make two (source files for the
        # receipt and pins, output files for the receipt), the floor of its CPU cost.
        hashes = [run_child(HASH, str(src))[0] for _ in range(args.repeat)]
        copies, converts, peaks, cpu = [], [], [], {"copy": [], "convert": []}
        for _ in range(args.repeat):             # alternate, so load drifts hit both alike
            wall, _, c = run_child(COPY, str(src), str(root / "copy"))
            copies.append(wall)
            cpu["copy"].append(c)
            shutil.rmtree(root / "copy")
            wall, peak, c = run_child(CONVERT, "convert", str(src), "-o", str(root / "out"),
                                      "--no-progress")
            converts.append(wall)
            peaks.append(peak)
            cpu["convert"].append(c)
            shutil.rmtree(root / "out")
        copy_s, conv_s = statistics.median(copies), statistics.median(converts)
        peak = max(peaks)
        result = {
            "source_bytes": src_bytes, "largest_tensor_bytes": largest,
            "copy_s_median": round(copy_s, 3), "convert_s_median": round(conv_s, 3),
            "copy_GBps": round(src_bytes / copy_s / 1e9, 3),
            "convert_GBps": round(src_bytes / conv_s / 1e9, 3),
            "convert_over_copy_speed": round(copy_s / conv_s, 3),
            "sha256_one_pass_s_median": round(statistics.median(hashes), 3),
            "peak_rss_bytes": peak, "fixed_overhead_rss_bytes": overhead,
            "peak_over_largest_tensor": round(peak / largest, 3),
            "goal_speed_met": copy_s / conv_s >= 0.5,
            "goal_memory_met": peak <= 2 * largest + overhead,
            "cpu_s_median": {k: round(statistics.median(v), 2) for k, v in cpu.items()},
            "load_average": os.getloadavg(),
            "runs": {"copy_s": [round(x, 3) for x in copies],
                     "convert_s": [round(x, 3) for x in converts]},
        }
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
