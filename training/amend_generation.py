"""Step 6c: make the demo target's generation_config.json say greedy, and record it in the
receipt.

``mlx-dspark serve`` takes the defaults of a request's sampling fields from the model's
generation_config.json, as vLLM does (docs/serve.md); the converter copied the export's,
which names no sampling at all, so a request without ``temperature`` sampled at OpenAI's 1
and the README's curl example came back as random-looking text (issue 41). ``mlx_lm.server``
is greedy by default, and so is ``generate``. Two keys are added, read the same way by
transformers (``do_sample``) and vLLM (``temperature``); every other key is kept. The
receipt's output entry for generation_config.json is set to the new file, with a note, so
that ``mlx-dspark verify`` and the load gate check the file that ships; the source entry (the
export as converted) is left as the conversion wrote it.

    .venv/bin/python training/amend_generation.py      # mlx_dspark/demo/target
"""
import hashlib
import json
from pathlib import Path

TARGET = Path(__file__).resolve().parents[1] / "mlx_dspark" / "demo" / "target"
GREEDY = {"do_sample": False, "temperature": 0.0}
NOTE = ("generation_config.json given do_sample false and temperature 0.0 (greedy) after "
        "conversion by training/amend_generation.py (issue 41; no weight depends on it); its "
        "output entry is the new file's")


def amend(folder: Path):
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **GREEDY}, indent=2) + "\n")
    receipt_path = folder / "MERERUN_CONVERSION.json"
    receipt = json.loads(receipt_path.read_text())
    data = path.read_bytes()
    receipt["outputs"]["generation_config.json"] = {"size": len(data),
                                                    "sha256": hashlib.sha256(data).hexdigest()}
    notes = [n for n in receipt.get("amended", "").split("\n")
             if n and "amend_generation" not in n]
    receipt["amended"] = "\n".join(notes + [NOTE])
    receipt_path.write_text(json.dumps(receipt, indent=2) + "\n")
    print(f"{path}: greedy, sha256 {receipt['outputs']['generation_config.json']['sha256'][:12]}")


if __name__ == "__main__":
    amend(TARGET)
