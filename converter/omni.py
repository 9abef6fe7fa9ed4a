"""The Nemotron Omni / VL wrapper as a text target: NVIDIA's multimodal parent
(``NemotronH_Nano_VL_V2``, ``NemotronH_Nano_Omni_Reasoning_V3``, ...) holds a plain Nemotron-H
text tower under ``language_model.`` beside its vision (``vision_model.``), projector
(``mlp1.``) and audio (``sound_encoder.``) towers. Read as vLLM reads it: the tower's config
(``llm_config`` or ``text_config``) and the tower's tensors with ``language_model.`` taken off;
every other tensor is media, never loaded for text. ``mlx-dspark convert`` writes the tower in
the converted layout under its plain names and carries the media tensors as exported, so the
same reading serves a Hugging Face download, a ModelOpt export and a conversion. MLX-free."""

from __future__ import annotations

import json
import os

SPELLINGS = ("nemotronh_nano_vl_v2", "nemotronh_nano_omni_reasoning_v3",
             "nemotronh_omni_reasoning_v3", "nemotron_h_omni")
"""``architectures`` / ``model_type`` values of the wrapper, lower-cased (any case is taken)."""
TEXT_KEYS = ("llm_config", "text_config")
TOWER = "language_model."
TEXT_TENSORS = ("backbone.", "lm_head.", "mtp.")
"""The tower's names once converted (``mlx-dspark convert`` writes them without the prefix)."""
WRAPPER = "omni_wrapper"
"""Key the text config carries: the wrapper's own spelling, so its readers know its files."""


def wrapper_name(config: dict) -> str | None:
    """The wrapper's spelling when ``config`` (a config.json) is an Omni / VL wrapper."""
    archs = config.get("architectures")
    names = [config.get("model_type"), *(archs if isinstance(archs, list) else [])]
    return next((n for n in names if isinstance(n, str) and n.lower() in SPELLINGS), None)


def text_config(config: dict, where) -> dict:
    """The tower's config of the wrapper ``config``: its ``llm_config`` (or ``text_config``)
    with the wrapper's quantization description (ModelOpt's and the converter's live at the top
    level) and :data:`WRAPPER`; ValueError in one line when it has none."""
    name = wrapper_name(config)
    inner = next((config[k] for k in TEXT_KEYS if isinstance(config.get(k), dict)), None)
    if inner is None:
        raise ValueError(f"{where}: a Nemotron Omni wrapper ({name}) without its text tower's "
                         f"config (llm_config or text_config)")
    text = {**inner, WRAPPER: name}
    for key in ("quantization", "quantization_config"):
        if key in config:
            text[key] = config[key]
    return text


def with_text_config(config: dict, text: dict) -> dict:
    """The wrapper ``config`` with its tower's config replaced by ``text`` (the converter's
    filled layer pattern); the quantization description stays at the top level."""
    key = next(k for k in TEXT_KEYS if isinstance(config.get(k), dict))
    inner = {k: v for k, v in text.items()
             if k not in (WRAPPER, "quantization", "quantization_config")}
    return {**config, key: inner}


def tower_name(name: str) -> str | None:
    """A wrapper tensor's name in the tower (``language_model.`` taken off), or None for a
    media tensor (vision, projector, audio)."""
    if name.startswith(TOWER):
        return name[len(TOWER):]
    return name if name.startswith(TEXT_TENSORS) else None


def is_wrapper_dir(path) -> bool:
    """Whether the directory's config.json is an Omni / VL wrapper (False when it cannot be
    read: the loaders name that problem themselves)."""
    try:
        with open(os.path.join(str(path), "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and wrapper_name(config) is not None


def renamer(path):
    """``name -> tower name or None`` for the tensors of the directory ``path``: the identity
    unless it is an Omni wrapper."""
    return tower_name if is_wrapper_dir(path) else (lambda name: name)


def tower_pattern(pattern: str) -> str:
    """A quantization config's module name or glob in the tower's names (``language_model.``
    taken off; media modules are carried as exported and never asked about)."""
    return pattern[len(TOWER):] if pattern.startswith(TOWER) else pattern
