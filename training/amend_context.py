"""Step 6b: declare the demo pair's context as 65,536 tokens, and record it in the receipts.

Step 2 sized the context at 4,096 tokens (shapes.py's max_position_embeddings), and the target
converter copied that into config.json, where `TargetModel.context_limit` reads it. Nothing
else depends on it: the target's attention has no positional encoding (Nemotron-H's, like its
Mamba layers, takes positions from order alone) and the DSpark drafter's attention is a
128-token window over relative (RoPE) positions, so a longer prompt runs the same weights
(issue 30: coding agents send 8k-40k-token prompts). Only the number changes: the line
`"max_position_embeddings": 4096` of each config.json is rewritten, every other byte kept,
and the receipt's output entry for config.json is set to the new file, with a note, so that
`mlx-dspark verify` and the load gate check the file that ships. Source entries (the ModelOpt
export as converted) are left as the conversion wrote them.

    .venv/bin/python training/amend_context.py      # mlx_dspark/demo/{target,drafter}
"""
import hashlib
import json
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "mlx_dspark" / "demo"
CONTEXT = 65536
OLD = '"max_position_embeddings": 4096,'
NOTE = (f"config.json's max_position_embeddings raised from 4096 to {CONTEXT} after conversion "
        f"by training/amend_context.py (issue 30; no weight depends on it); its output entry is "
        f"the new file's")


def amend(folder: Path):
    config = folder / "config.json"
    text = config.read_text()
    new = f'"max_position_embeddings": {CONTEXT},'
    if OLD in text:
        config.write_text(text.replace(OLD, new, 1))
    elif new not in text:
        raise SystemExit(f"{config}: no max_position_embeddings line to amend")
    receipt_path = folder / "MERERUN_CONVERSION.json"
    receipt = json.loads(receipt_path.read_text())
    data = config.read_bytes()
    receipt["outputs"]["config.json"] = {"size": len(data),
                                         "sha256": hashlib.sha256(data).hexdigest()}
    notes = [n for n in receipt.get("amended", "").split("\n") if n and "amend_context" not in n]
    receipt["amended"] = "\n".join(notes + [NOTE])
    receipt_path.write_text(json.dumps(receipt, indent=2) + "\n")
    print(f"{config}: max_position_embeddings {CONTEXT}, sha256 {receipt['outputs']['config.json']['sha256'][:12]}")


if __name__ == "__main__":
    for kind in ("target", "drafter"):
        amend(DEMO / kind)
