"""Step 6a: record a replaced chat template in the demo pair's conversion receipts.

The chat template is tokenizer metadata that `mlx-dspark convert` copies byte for byte (source
and output hashes are equal); the weights never depend on it. When the template is rewritten
(issue 22: Nemotron's format, with the <think> block and tool calls), the receipt's entries for
chat_template.jinja are updated to the new file and an "amended" note says so, so that
`mlx-dspark verify` and the load gate check the file that ships. Every other entry is left as
the conversion wrote it.

    .venv/bin/python training/amend_template.py      # both mlx_dspark/demo/{target,drafter}
"""
import hashlib
import json
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "mlx_dspark" / "demo"
NAME = "chat_template.jinja"
NOTE = ("chat_template.jinja replaced after conversion by training/amend_template.py "
        "(Nemotron-format template, issue 22); its source and output entries are the new file's")


def amend(folder: Path):
    receipt_path = folder / "MERERUN_CONVERSION.json"
    receipt = json.loads(receipt_path.read_text())
    data = (folder / NAME).read_bytes()
    entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    receipt["source"]["files"][NAME] = dict(entry)
    receipt["outputs"][NAME] = dict(entry)
    notes = [n for n in receipt.get("amended", "").split("\n") if n and "amend_template" not in n]
    receipt["amended"] = "\n".join([NOTE] + notes)
    receipt_path.write_text(json.dumps(receipt, indent=2) + "\n")
    print(f"{receipt_path}: {NAME} {entry['sha256'][:12]}, {entry['size']} bytes")


if __name__ == "__main__":
    for kind in ("target", "drafter"):
        amend(DEMO / kind)
