"""Step 4r: rebuild step 4's ModelOpt export from the shipped demo target, bit for bit.

`mlx-dspark convert` only relabels bytes (NVFP4 codes U8 -> uint32, FP8 block scales ->
uint8 `scales`, routed experts stacked), so its output holds every source byte and the export
can be recovered without retraining the target (steps 3-4, ~50 min here). The rebuilt
model.safetensors is checked against the SHA-256 that the conversion receipt recorded for the
source file, so the drafter (step 5) is trained against exactly the weights that ship.

    /work/venv-fx/bin/python training/recover_target.py   # mlx_dspark/demo/target -> training/work/target_nvfp4
    /work/venv-fx/bin/python training/recover_target.py --drafter   # demo/drafter -> work/drafter_nvfp4

The second form rebuilds step 5b's packed drafter the same way (train_drafter.py --init starts
from it).
"""
import argparse
import hashlib
import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file
from mlx_dspark.converter.layout import load_receipt

from data import HERE, WORK

KINDS = {"target": ("target", "target_nvfp4"), "drafter": ("drafter", "drafter_nvfp4")}
# Keys `mlx-dspark convert` adds to config.json; everything else is the source's.
CONVERTER_KEYS = ("hybrid_override_pattern", "quantization")
MTP_FILE = "model-mtp.safetensors"   # train_mtp.py (step 8) writes the block there
STACKED = re.compile(r"(.*\.experts)\.(\w+_proj)\.(weight|scales|weight_scale_2)$")


def source_name_and_tensor(name, t):
    """One converted tensor -> the export's (name, tensor) pairs; the bytes are unchanged."""
    m = STACKED.match(name)
    if m:  # routed experts: unstack along the leading axis
        stem, proj, leaf = m.groups()
        return [pair for e in range(t.shape[0])
                for pair in source_name_and_tensor(f"{stem}.{e}.{proj}.{leaf}", t[e].clone())]
    if name.endswith(".scales"):  # FP8 E4M3 block scales, stored as their bytes
        return [(name[:-len(".scales")] + ".weight_scale", t.view(torch.float8_e4m3fn))]
    if t.dtype == torch.uint32:  # NVFP4 codes: 8 per uint32 -> 2 per byte, same byte order
        return [(name, t.view(torch.uint8))]
    return [(name, t)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", action="store_true", help="the DSpark drafter instead of the target")
    demo, out = KINDS["drafter" if ap.parse_args().drafter else "target"]
    recover(HERE.parent / "mlx_dspark" / "demo" / demo, WORK / out)


def recover(demo, out):
    receipt = load_receipt(demo)
    if receipt is None:
        raise SystemExit(f"{demo}: no conversion receipt, so nothing to check the rebuilt export against")
    files = {}   # the export's file -> its tensors; train_mtp.py's block was a second file
    for name, t in load_file(demo / "model.safetensors").items():
        file = MTP_FILE if name.startswith("mtp.") else "model.safetensors"
        files.setdefault(file, {}).update(source_name_and_tensor(name, t))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for file, tensors in files.items():
        save_file(tensors, out / file, metadata={"format": "pt"})
    config = json.loads((demo / "config.json").read_text())
    for key in CONVERTER_KEYS:
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "hf_quant_config.json"):
        if (demo / f).exists():
            shutil.copy(demo / f, out / f)
    for file, tensors in files.items():
        want = receipt["source"]["files"][file]["sha256"]
        got = hashlib.sha256((out / file).read_bytes()).hexdigest()
        print(f"{file}: {len(tensors)} tensors, sha256 {got}")
        if got != want:
            raise SystemExit(f"{out / file}: sha256 {got} differs from the receipt's source {want}")
    print("identical to the source the receipt recorded")


if __name__ == "__main__":
    main()
