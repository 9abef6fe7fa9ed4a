"""Step 4r: rebuild step 4's ModelOpt export from the shipped demo target, bit for bit.

`mlx-dspark convert` only relabels bytes (NVFP4 codes U8 -> uint32, FP8 block scales ->
uint8 `scales`, routed experts stacked), so its output holds every source byte and the export
can be recovered without retraining the target (steps 3-4, ~50 min here). The rebuilt
model.safetensors is checked against the SHA-256 that the conversion receipt recorded for the
source file, so the drafter (step 5) is trained against exactly the weights that ship.

    /work/venv-fx/bin/python training/recover_target.py   # mlx_dspark/demo/target -> training/work/target_nvfp4
"""
import hashlib
import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file
from mlx_dspark.converter.layout import load_receipt

from data import HERE, WORK

DEMO = HERE.parent / "mlx_dspark" / "demo" / "target"
OUT = WORK / "target_nvfp4"
# Keys `mlx-dspark convert` adds to config.json; everything else is the source's.
CONVERTER_KEYS = ("hybrid_override_pattern", "quantization")
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
    receipt = load_receipt(DEMO)
    if receipt is None:
        raise SystemExit(f"{DEMO}: no conversion receipt, so nothing to check the rebuilt export against")
    want = receipt["source"]["files"]["model.safetensors"]["sha256"]
    tensors = {}
    for name, t in load_file(DEMO / "model.safetensors").items():
        tensors.update(source_name_and_tensor(name, t))
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    save_file(tensors, OUT / "model.safetensors", metadata={"format": "pt"})
    got = hashlib.sha256((OUT / "model.safetensors").read_bytes()).hexdigest()
    config = json.loads((DEMO / "config.json").read_text())
    for key in CONVERTER_KEYS:
        config.pop(key)
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(DEMO / f, OUT / f)
    print(f"{len(tensors)} tensors; model.safetensors sha256 {got}")
    if got != want:
        raise SystemExit(f"{OUT / 'model.safetensors'}: sha256 {got} differs from the receipt's source {want}")
    print("identical to the source the receipt recorded")


if __name__ == "__main__":
    main()
