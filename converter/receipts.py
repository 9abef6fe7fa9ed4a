"""Source pins and conversion receipts (docs/design.md §4).

Pins (the repository's top-level MERERUN_CONVERSION.json, shipped in the package as
pins.json) name each NVIDIA source repo, its revision and whatever file hashes someone has
actually computed; "unknown" marks the rest. A source that contradicts a known pin is refused;
anything not pinned is reported as such, never silently trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import ConversionError
from .safetensors_io import open_regular

UNKNOWN = "unknown"
PINS_FORMAT = "mlx-dspark-pins/1"
RECEIPT_FORMAT = "mlx-dspark-receipt/1"


def load_pins(path: Path | None = None) -> dict:
    """The packaged pins, or the file at ``path``; returns {repo_id: pin}."""
    try:
        if path is None:
            text = resources.files(__package__).joinpath("pins.json").read_text("utf-8")
            path = Path("pins.json")
        else:
            with open_regular(Path(path)) as f:
                text = f.read().decode("utf-8")
        pins = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    except RecursionError:
        raise ConversionError(f"{path}: invalid JSON (nested too deeply)") from None
    if not isinstance(pins, dict) or pins.get("format") != PINS_FORMAT \
            or not isinstance(pins.get("sources"), dict):
        raise ConversionError(f"{path}: not a pin file (format must be {PINS_FORMAT!r})")
    for repo, pin in pins["sources"].items():
        why = _bad_pin(pin)
        if why:
            raise ConversionError(f"{path}: pin for {repo!r}: {why}")
    return pins["sources"]


def _bad_pin(pin) -> str | None:
    """Why a pin entry is malformed, or None: checked once here so that checking files
    against it never meets a wrong type."""
    if not isinstance(pin, dict):
        return "not an object"
    if not isinstance(pin.get("revision", UNKNOWN), str):
        return "revision must be a string"
    files = pin.get("files", UNKNOWN)
    if files == UNKNOWN:
        return None
    if not isinstance(files, dict):
        return f"files must be an object or {UNKNOWN!r}"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256", UNKNOWN), str)
                and type(entry.get("size", 0)) is int):
            return f"files[{name!r}] must be {{\"sha256\": str, \"size\": int}}"
    return None


def pinned_revision(pins: dict, repo_id: str | None) -> str | None:
    rev = (pins.get(repo_id) or {}).get("revision") if repo_id else None
    return None if rev in (None, UNKNOWN) else rev


@dataclass
class PinCheck:
    """Checks source files against one repo's pins as their hashes arrive."""
    repo_id: str | None
    revision: str | None
    pins: dict
    src: Path
    verified: list[str] = field(default_factory=list)
    unpinned: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.pin = self.pins.get(self.repo_id) if self.repo_id else None
        want = pinned_revision(self.pins, self.repo_id)
        if want and self.revision and self.revision != want:
            raise ConversionError(
                f"{self.src}: revision {self.revision} of {self.repo_id} contradicts the pinned "
                f"revision {want} (MERERUN_CONVERSION.json)")

    def check_file(self, name: str, size: int, sha256: str) -> None:
        files = self.pin.get("files") if self.pin else None
        entry = files.get(name) if isinstance(files, dict) else None
        if not entry or entry.get("sha256", UNKNOWN) == UNKNOWN:
            self.unpinned.append(name)
            return
        if entry["sha256"] != sha256 or entry.get("size", size) != size:
            raise ConversionError(
                f"{self.src / name}: sha256 {sha256} (size {size}) contradicts the pin "
                f"{entry['sha256']} (size {entry.get('size', '?')}) for {self.repo_id} in "
                f"MERERUN_CONVERSION.json")
        self.verified.append(name)

    def summary(self) -> dict:
        if self.pin is None:
            why = ("source not identified as a Hugging Face repo (pass --repo-id)"
                   if self.repo_id is None else f"no pin for {self.repo_id}")
            return {"status": "unpinned", "detail": why}
        want = pinned_revision(self.pins, self.repo_id)
        revision_ok = bool(want) and self.revision == want
        status = ("pinned" if not self.unpinned and self.verified
                  else "partially pinned" if self.verified or revision_ok else "unpinned")
        return {"status": status, "pinned_revision": self.pin.get("revision", UNKNOWN),
                "revision_verified": revision_ok, "verified_files": sorted(self.verified),
                "unpinned_files": sorted(self.unpinned)}


def receipt(*, version: str, layout: str, kind: str, options: dict, repo_id, revision,
            source_files: dict, pins: dict, outputs: dict) -> str:
    """The receipt text: fixed key order, no timestamps or paths, so it is reproducible."""
    doc = {
        "format": RECEIPT_FORMAT,
        "converter": {"name": "mlx-dspark convert", "version": version, "layout": layout},
        "model_kind": kind,
        "options": options,
        "source": {"repo_id": repo_id, "revision": revision,
                   "files": dict(sorted(source_files.items()))},
        "pins": pins,
        "outputs": dict(sorted(outputs.items())),
    }
    return json.dumps(doc, indent=2) + "\n"
