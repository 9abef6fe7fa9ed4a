"""ModelOpt quantization configs and the config.json quirks of real exports (docs/design.md §4)."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import ConversionError
from .layout import BLOCK_CHARS, GROUP_SIZE, decode_float, layer_pattern
from .omni import tower_pattern
from .safetensors_io import open_regular

# ModelOpt algorithm -> the converted layout; everything else is refused because its bytes
# cannot be carried into MLX verbatim (AWQ/SVDQuant need pre_quant_scale and LoRA terms,
# per-channel/block FP8 and INT formats have no matching MLX container here).
ALGO_FORMAT = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8"}
MIXED = "MIXED_PRECISION"

# ModelOpt 0.47 leaves a name-mapping sentinel such as "\u0000backbone.pt_name_sentinel" in
# module names, sometimes before a trailing "*": drop it up to (not including) the "*".
_SENTINEL = re.compile(r"\x00[^*]*")


def strip_sentinel(name: str) -> str:
    if "\x00" not in name:
        return name
    name = _SENTINEL.sub("", name)
    return name[:-1] if name.endswith(".") else name


def normalize_json(value):
    """Remove sentinels from every string (keys too) and decode {"__float__": "Infinity"}."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return decode_float(value)
        return {strip_sentinel(k): normalize_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize_json(v) for v in value]
    if isinstance(value, str):
        return strip_sentinel(value)
    return value


def load_json(path: Path):
    with open_regular(path) as f:
        raw = f.read()
    try:
        return normalize_json(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    except RecursionError:
        raise ConversionError(f"{path}: invalid JSON (nested too deeply)") from None


def fill_layer_pattern(config: dict, path: Path) -> dict:
    """Nemotron-H configs from transformers 5 carry `layers_block_type` instead of
    `hybrid_override_pattern`; the runtime reads the pattern, so derive it (and refuse a
    config whose two spellings, or whose layer count, disagree)."""
    types = config.get("layers_block_type")
    pattern = config.get("hybrid_override_pattern")
    if pattern is not None and not (isinstance(pattern, str)
                                    and set(pattern) <= set(BLOCK_CHARS.values())):
        raise ConversionError(f"{path}: hybrid_override_pattern must be a string of M, E, * "
                              f"and -, got {pattern!r}")
    if types is not None:
        if not isinstance(types, list):
            raise ConversionError(f"{path}: layers_block_type must be a list, got {types!r}")
        try:
            derived = layer_pattern(types)
        except ValueError as e:
            raise ConversionError(f"{path}: {e}") from None
        if pattern is not None and pattern != derived:
            raise ConversionError(f"{path}: hybrid_override_pattern {pattern!r} contradicts "
                                  f"layers_block_type ({derived!r})")
        pattern = derived
    if pattern is None:
        raise ConversionError(f"{path}: Nemotron-H config without hybrid_override_pattern or "
                              f"layers_block_type")
    n = config.get("num_hidden_layers", len(pattern))
    if len(pattern) != n:
        raise ConversionError(f"{path}: layer pattern {pattern!r} has {len(pattern)} layers, "
                              f"num_hidden_layers is {n}")
    return {**config, "hybrid_override_pattern": pattern}


@dataclass
class QuantSpec:
    """Which layout the quantization config promises for each module.

    ``expected(prefix)`` is "nvfp4", "fp8" or None (unquantized) and ``explicit`` says whether
    the config names modules one by one (MIXED_PRECISION) or by exclusion globs."""
    algo: str | None
    source: str
    exclude: tuple[str, ...] = ()
    layers: dict[str, str] = field(default_factory=dict)

    @property
    def explicit(self) -> bool:
        return self.algo == MIXED

    def expected(self, prefix: str) -> str | None:
        if self.algo is None:
            return None
        if self.explicit:
            # MIXED_PRECISION lists routed experts once as "...mixer.experts": walk up the tree.
            parts = prefix.split(".")
            for i in range(len(parts), 0, -1):
                fmt = self.layers.get(".".join(parts[:i]))
                if fmt is not None:
                    return fmt
            return None
        if any(fnmatch.fnmatchcase(prefix, p) or fnmatch.fnmatchcase(prefix, p + ".*")
               for p in self.exclude):
            return None
        return ALGO_FORMAT[self.algo]


def _check_algo(algo, group_size, where: str) -> str:
    if not isinstance(algo, str) or algo not in ALGO_FORMAT:
        raise ConversionError(
            f"{where}: unsupported quant_algo {algo!r} (supported: "
            f"{', '.join(sorted(ALGO_FORMAT))}, {MIXED}); its tensors cannot be copied "
            f"verbatim into MLX's layout")
    if ALGO_FORMAT[algo] == "nvfp4" and group_size not in (None, GROUP_SIZE):
        raise ConversionError(f"{where}: NVFP4 group_size {group_size} (only 16 exists)")
    return ALGO_FORMAT[algo]


def check_quant_method(config: dict, where) -> None:
    """Refuse a config whose ``quantization_config`` is not ModelOpt's (GPTQ, AWQ, ...): its
    tensors are no ModelOpt bytes to copy."""
    qc = config.get("quantization_config")
    method = qc.get("quant_method", "modelopt") if isinstance(qc, dict) else "modelopt"
    if method != "modelopt":
        raise ConversionError(
            f"{where}: unsupported quant_method {method!r} (only ModelOpt exports)")


def parse_quant_spec(src: Path, config: dict) -> QuantSpec:
    """Read hf_quant_config.json (preferred) or config.json's quantization_config."""
    hf_path = src / "hf_quant_config.json"
    qc = config.get("quantization_config")
    if hf_path.is_file():
        q = load_json(hf_path)
        q = q.get("quantization", q) if isinstance(q, dict) else None
        where = hf_path
        if not isinstance(q, dict):
            raise ConversionError(f"{hf_path}: no 'quantization' object")
        if isinstance(qc, dict) and qc.get("quant_algo") not in (None, q.get("quant_algo")):
            raise ConversionError(
                f"{hf_path}: quant_algo {q.get('quant_algo')!r} contradicts config.json's "
                f"quantization_config ({qc.get('quant_algo')!r})")
    elif isinstance(qc, dict):
        q, where = qc, src / "config.json"
        check_quant_method(config, where)
    else:
        return QuantSpec(algo=None, source="none")

    algo = q.get("quant_algo")
    if algo is None and not q.get("quantized_layers"):
        return QuantSpec(algo=None, source=str(where.name))
    if algo == MIXED:
        layers = {}
        listed = q.get("quantized_layers") or {}
        if not isinstance(listed, dict):
            raise ConversionError(f"{where}: quantized_layers must be an object")
        for name, entry in listed.items():
            if not isinstance(entry, dict):
                raise ConversionError(f"{where}: quantized_layers[{name!r}] is not an object")
            layers[name] = _check_algo(entry.get("quant_algo"), entry.get("group_size"),
                                       f"{where}: quantized_layers[{name!r}]")
        if not layers:
            raise ConversionError(f"{where}: MIXED_PRECISION without quantized_layers")
        return QuantSpec(algo=MIXED, source=where.name, layers=layers)
    _check_algo(algo, q.get("group_size"), str(where))
    exclude = q.get("exclude_modules", q.get("ignore")) or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConversionError(f"{where}: exclude_modules must be a list of strings")
    return QuantSpec(algo=algo, source=where.name, exclude=tuple(exclude))


def tower_spec(spec: QuantSpec) -> QuantSpec:
    """An Omni wrapper's quantization description in its text tower's names (ModelOpt names
    the modules from the parent: ``language_model.backbone...``)."""
    return replace(spec, exclude=tuple(tower_pattern(p) for p in spec.exclude),
                   layers={tower_pattern(k): v for k, v in spec.layers.items()})
