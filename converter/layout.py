"""The converted-checkpoint contract (ARCHITECTURE.md, "Converted checkpoint layout"): what the
converter writes and the runtime reads. One owner, so the two cannot drift apart.

MLX-free (the converter and ``mlx-dspark --help`` import it)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat

LAYOUT = "mlx-dspark/1"
"""``config.json``'s ``quantization.layout`` in every converted directory."""

GROUP_SIZE = 16
"""NVFP4 block size: one E4M3 scale per 16 weights."""

RECEIPT_NAME = "MERERUN_CONVERSION.json"
"""The converter's receipt beside the weights (sha256 and size of every output file)."""

RECEIPT_BLOCK_BYTES = 16 << 20
"""Weight files are also hashed per block of this many bytes (the receipt's ``blocks``), so a
load can check a sample of a large file without reading all of it."""

WEIGHT_FILES = "model*.safetensors"
"""The weight files of a converted directory (matched against file names, never as a path
pattern: a directory may well be called ``m*``)."""

BLOCK_CHARS = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*",
               "full_attention": "*", "mlp": "-"}
"""transformers-5 ``layers_block_type`` names -> Nemotron-H ``hybrid_override_pattern``
characters (Mamba-2, MoE, attention, dense MLP)."""


def layer_pattern(kinds) -> str:
    """The ``hybrid_override_pattern`` spelled by a ``layers_block_type`` list; ValueError when
    an entry is no block kind."""
    try:
        return "".join(BLOCK_CHARS[k] for k in kinds)
    except (KeyError, TypeError):
        raise ValueError(f"unknown entry in layers_block_type {kinds!r}") from None


def mtp_pattern(config: dict) -> str:
    """The native MTP block's layer pattern as NVIDIA's configs spell it
    (``mtp_hybrid_override_pattern``, or transformers-5's ``mtp_layers_block_type``), repeated
    ``num_nextn_predict_layers`` times; "" when the config declares no MTP block."""
    steps = config.get("num_nextn_predict_layers") or 0
    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None and config.get("mtp_layers_block_type") is not None:
        pattern = layer_pattern(config["mtp_layers_block_type"])
    if not isinstance(steps, int) or not isinstance(pattern, str):
        return ""
    return pattern * steps


LATENT_PROJ = ".mixer.fc1_latent_proj.weight"
"""The tensor that makes an MoE layer latent (its rows: the latent width)."""


def latent_problem(config: dict, shapes: dict, config_path) -> str | None:
    """Whether config.json's ``moe_latent_size`` says what the tensors say (``shapes``: name ->
    shape, or None where only names are known): a latent MoE's layers hold
    ``mixer.fc1_latent_proj`` of ``moe_latent_size`` rows, a full-width MoE's none. The one line
    naming config.json and the field when they disagree, else None."""
    size = config.get("moe_latent_size")
    if size is not None and (type(size) is not int or size <= 0):
        return f"{config_path}: moe_latent_size must be a positive integer or null, got {size!r}"
    latent = {n: s for n, s in shapes.items() if n.endswith(LATENT_PROJ)}
    if latent and size is None:
        name = min(latent)
        return (f"{config_path}: no moe_latent_size, but the tensors hold a latent MoE ({name}): "
                f"this config.json does not describe these weights")
    moe = any(n.endswith(".mixer.gate.weight") for n in shapes)
    if size is not None and moe and not latent:
        return (f"{config_path}: moe_latent_size {size}, but the MoE layers have no "
                f"fc1_latent_proj (their experts run at full width): this config.json does not "
                f"describe these weights")
    for name, shape in sorted(latent.items()):
        if shape is not None and shape[0] != size:
            return (f"{config_path}: moe_latent_size {size}, but {name} projects to "
                    f"{shape[0]}: this config.json does not describe these weights")
    return None


SPECULATORS_BLOCK_KINDS = ("dspark", "dflash")
"""``speculators_model_type`` values of block drafters saved by vllm-project/speculators."""


def speculators_refusal(config: dict, config_path) -> str | None:
    """The one line refusing a DSpark or DFlash drafter saved in vllm-project/speculators'
    convention (``speculators_model_type``, or ``speculators_config.algorithm``), else None.
    Its offsets are not NVIDIA's: with ``sample_from_anchor`` true (speculators' DSpark default)
    the block is anchor-first, slot j predicting anchor+j+1 where NVIDIA's slot j predicts
    anchor+j, and ``aux_hidden_state_layer_ids`` count layers done (NVIDIA's
    ``target_layer_ids`` are one less). Read as NVIDIA's layout every slot is one position
    early and acceptance collapses to about one token per round with no error (SGLang's
    sgl-project/sglang#30261); until that block is implemented here it is refused by name."""
    spec = config.get("speculators_config")
    kind = config.get("speculators_model_type") or (
        spec.get("algorithm") if isinstance(spec, dict) else None)
    if kind not in SPECULATORS_BLOCK_KINDS:
        return None
    anchor = config.get("sample_from_anchor")
    block = {True: "anchor-first (sample_from_anchor true: slot j predicts anchor+j+1, "
                   "NVIDIA's slot j anchor+j)",
             False: "1+N (sample_from_anchor false)"}.get(
        anchor, "of unstated slots (no sample_from_anchor: anchor-first by speculators' "
                "default, 1+N in older exports)")
    return (f"{config_path}: a {kind} drafter in the vllm-project/speculators convention "
            f"(speculators_model_type {kind!r}), whose offsets are not NVIDIA's: its block is "
            f"{block} and its aux_hidden_state_layer_ids count layers done; read as NVIDIA's "
            f"layout its acceptance would collapse to about 1 token per round (sglang#30261), "
            f"so it is not loaded: use a drafter in NVIDIA's layout (Qwen3DSparkModel or "
            f"DFlashDraftModel)")


def target_tensor_names(config: dict) -> list[str]:
    """The tensors (a linear module by its ``.weight``) the runtime's loader asks for in a
    converted Nemotron-H target of ``config`` (its ``hybrid_override_pattern`` filled in)."""
    names = ["backbone.embeddings.weight", "backbone.norm_f.weight"]
    if not config.get("tie_word_embeddings"):
        names.append("lm_head.weight")
    blocks = {"M": ("in_proj.weight", "out_proj.weight", "conv1d.weight", "dt_bias", "A_log",
                    "D", "norm.weight"),
              "*": ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"),
              "-": ("up_proj.weight", "down_proj.weight"),
              "E": ("gate.weight", "gate.e_score_correction_bias", "experts.up_proj.weight",
                    "experts.down_proj.weight", "shared_experts.up_proj.weight",
                    "shared_experts.down_proj.weight")}
    if config.get("moe_latent_size") is not None:
        blocks["E"] += ("fc1_latent_proj.weight", "fc2_latent_proj.weight")
    for i, kind in enumerate(config["hybrid_override_pattern"]):
        names.append(f"backbone.layers.{i}.norm.weight")
        names += [f"backbone.layers.{i}.mixer.{n}" for n in blocks[kind]]
    return names


def decode_float(v) -> float:
    """A config number, including ModelOpt's ``{"__float__": "Infinity"}`` for non-finite ones."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        try:
            return float(v["__float__"])
        except (TypeError, ValueError):
            raise ValueError(f"bad __float__ value {v['__float__']!r}") from None
    return float(v)


def weight_files(path: str) -> list[str]:
    """The directory's ``model*.safetensors`` files, in the order they are read."""
    return [os.path.join(path, n) for n in sorted(os.listdir(path))
            if fnmatch.fnmatchcase(n, WEIGHT_FILES)]


class BlockHash:
    """SHA-256 of each ``block_bytes`` block of a stream fed in any pieces (the receipt's
    ``blocks`` of a weight file; the whole-file hash is a separate pass, run beside it)."""

    def __init__(self, block_bytes: int = RECEIPT_BLOCK_BYTES):
        self.block_bytes = block_bytes
        self._block, self._filled = hashlib.sha256(), 0
        self._done: list[str] = []

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.block_bytes - self._filled)
            self._block.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self._done.append(self._block.hexdigest())
                self._block, self._filled = hashlib.sha256(), 0

    def blocks(self) -> dict:
        """The receipt's ``blocks`` entry: the block size and each block's sha256."""
        tail = [self._block.hexdigest()] if self._filled else []
        return {"size": self.block_bytes, "sha256": self._done + tail}


def load_receipt(path) -> dict | None:
    """The directory's receipt document, or None when it has none. Raises OSError on a receipt
    that is not a regular file (a FIFO would block every load) and ValueError (JSON, UTF-8,
    RecursionError aside) on one that does not parse; its fields are the caller's to check."""
    receipt = os.path.join(path, RECEIPT_NAME)
    if not os.path.lexists(receipt):
        return None
    fd = os.open(receipt, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{receipt}: not a regular file")
        return json.loads(fh.read().decode("utf-8"))
