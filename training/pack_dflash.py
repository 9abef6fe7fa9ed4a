"""Step 10b: write the trained DFlash head (train_dflash.py's BF16 ``dflash_export``) as NVIDIA's
Lightning DFlash export: z-lab's tensor names, NVFP4-packed by ModelOpt's own export pieces
(dspark_drafter_export.pack: W4A16_NVFP4 on ``fc`` and ``mlp.*``, attention and norms BF16),
config.json with ModelOpt's ``quantization_config`` plus hf_quant_config.json.

    PYTHONPATH=training $FX training/pack_dflash.py      # work/dflash_export -> work/dflash_nvfp4
    mlx-dspark convert training/work/dflash_nvfp4 -o mlx_dspark/demo/dflash
"""
import json
import shutil

import torch
from safetensors.torch import load_file

from data import WORK
from dspark_drafter_export import DSparkDrafter, write_export

SRC, OUT = WORK / "dflash_export", WORK / "dflash_nvfp4"


def main():
    c = json.loads((SRC / "config.json").read_text())
    model = DSparkDrafter(c)                    # without markov_rank: DFlash's module tree
    missing, unexpected = model.load_state_dict(load_file(SRC / "model.safetensors"), strict=False)
    # nn.RMSNorm's eps is the config's; the tree has no other state than the exported tensors.
    assert not missing and not unexpected, (missing, unexpected)
    shutil.rmtree(OUT, ignore_errors=True)
    write_export(OUT, c, model.to(torch.bfloat16).eval())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
