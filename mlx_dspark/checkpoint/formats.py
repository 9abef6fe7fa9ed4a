"""What a target checkpoint is, read from its config and its tensor names before a weight is
loaded: the layout that loads (docs/formats.md), or a one-line refusal that names the format
and what to use instead.

Layouts: ``mlx-dspark`` (``mlx-dspark convert``'s output, with a receipt), ``mlx-lm``
(``mlx_lm.convert``'s: stacked ``switch_mlp`` experts, MLX quantization under
``quantization``), ``hf`` (a plain Hugging Face download in BF16/FP16/FP32) and ``modelopt``
(NVIDIA's NVFP4/FP8 export, which ``convert`` turns into the first). The same reading serves a
local directory (its safetensors headers) and a repo id (its ``config.json`` and safetensors
index alone, before any large download: checkpoint/hub.py). MLX-free."""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

from ..converter.layout import latent_problem, weight_files
from ..converter.mlx_layouts import Format, dense_precision, mlx_layout
from ..converter.omni import renamer, text_config, wrapper_name
from .integrity import CheckpointError, checkpoint_files

QUANT_METHODS = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes",
                 "compressed-tensors": "compressed-tensors", "fp8": "FP8 (block-scaled)",
                 "hqq": "HQQ", "aqlm": "AQLM", "eetq": "EETQ", "torchao": "torchao",
                 "mxfp4": "MXFP4 (Hugging Face)", "bitnet": "BitNet"}
INSTEAD = ("use NVIDIA's BF16 or NVFP4 release (--model takes its repo id), or an mlx-lm "
           "conversion of it (mlx_lm.convert)")


class UnsupportedFormat(CheckpointError):
    """A checkpoint in a format mlx-dspark does not run: the message names the format and
    what to use instead."""


def read_target_config(path) -> dict:
    """``path/config.json``, refused in one line when it is not a Nemotron-H target: a DSpark
    drafter or an EAGLE-3 head (they go to ``--drafter``), or another architecture."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path}: missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: not a JSON object")
    return check_target_config(raw, path)


def check_target_config(raw: dict, path) -> dict:
    """``raw`` when it configures a Nemotron-H target (an Omni / VL wrapper: its text tower's
    config, converter/omni.py), else ValueError in one line."""
    if wrapper_name(raw) is not None:
        raw = text_config(raw, path)
    archs = raw.get("architectures") or []
    kind = raw.get("model_type")
    if "dflash_config" in raw or any("DSpark" in str(a) or "DFlash" in str(a) for a in archs):
        which = "DFlash" if any("DFlash" in str(a) for a in archs) else "DSpark"
        raise ValueError(f"{path}: a {which} drafter, not a target model; pass it as --drafter "
                         f"(drafter= in md.load) next to its Nemotron-H --model")
    if any("Eagle3" in str(a) for a in archs):
        raise ValueError(f"{path}: an EAGLE-3 head, not a target model; pass it as --drafter "
                         f"(drafter= in md.load) next to its Nemotron-H --model")
    if kind not in (None, "nemotron_h") and "hybrid_override_pattern" not in raw:
        what = f"model_type {kind!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
        raise ValueError(f"{path}: {what}: mlx-dspark runs Nemotron-H targets only "
                         f"(model_type 'nemotron_h'); other models run with mlx-lm")
    return raw


def detect(config: dict, tensors: dict, where, hf_quant_config: bool = False) -> Format:
    """The format of a Nemotron-H checkpoint from its config and ``tensors`` (name -> its
    safetensors dtype, or None where only names are known); UnsupportedFormat for one that
    no loader here runs."""
    latent = latent_problem(config, dict.fromkeys(tensors), Path(where) / "config.json")
    if latent:
        raise UnsupportedFormat(latent)
    mlx = mlx_layout(config, tensors)
    if mlx is not None:
        return mlx
    qc = config.get("quantization_config")
    method = str(qc.get("quant_method", "modelopt")).lower() if isinstance(qc, dict) else None
    if method == "modelopt" or (method is None and hf_quant_config):
        return Format("modelopt", str((qc or {}).get("quant_algo") or "ModelOpt"))
    if method is not None:
        name = QUANT_METHODS.get(method, method)
        raise UnsupportedFormat(f"{where}: {name} quantization (config.json quantization_config"
                                f" quant_method {method!r}): not a format mlx-dspark runs; "
                                f"{INSTEAD}")
    return Format("hf", dense_precision(config, tensors))


def file_kind(path) -> str:
    """What a file given where a directory belongs is, in a few words."""
    suffix = Path(path).suffix
    return {".gguf": "a GGUF file (llama.cpp's format)", ".safetensors": "a safetensors file",
            ".bin": "a PyTorch pickle"}.get(suffix, "a file")


def _refuse_foreign_files(path: Path) -> None:
    """GGUF files or PyTorch pickles where safetensors weights should be."""
    if path.is_file():
        raise UnsupportedFormat(f"{path}: {file_kind(path)}, not a checkpoint directory; "
                                f"mlx-dspark runs safetensors checkpoints: {INSTEAD}")
    if not path.is_dir():
        return                       # read_target_config names what is missing
    names = os.listdir(path)
    if weight_files(str(path)):
        return
    if fnmatch.filter(names, "*.gguf"):
        raise UnsupportedFormat(f"{path}: GGUF files (llama.cpp's format), no safetensors "
                                f"weights; mlx-dspark runs safetensors checkpoints: {INSTEAD}")
    if fnmatch.filter(names, "*.bin") or fnmatch.filter(names, "*.pt"):
        raise UnsupportedFormat(f"{path}: PyTorch pickles (*.bin/*.pt), no safetensors weights; "
                                f"mlx-dspark never unpickles: use the model's safetensors "
                                f"release")


def _headers(path: Path, files) -> dict:
    """name -> TensorInfo over ``files``' safetensors headers, each checked whole
    (converter/safetensors_io.read_header); an Omni wrapper's text tower alone, under its
    plain names."""
    from ..converter.errors import ConversionError
    from ..converter.safetensors_io import read_header

    tensors, rename = {}, renamer(path)
    try:
        for f in files:
            for n, t in read_header(Path(f)).items():
                if rename(n) is not None:
                    tensors[rename(n)] = t
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    return tensors


def _tensor_dtypes(path: Path) -> dict:
    """name -> safetensors dtype over the directory's weight files (headers only)."""
    return {n: t.dtype for n, t in _headers(path, weight_files(str(path))).items()}


def tensor_shapes(path) -> dict:
    """name -> shape over the weight files a load reads (integrity.checkpoint_files), from
    their headers alone: what a config is checked against before any weight is read."""
    return {n: t.shape for n, t in _headers(Path(path), checkpoint_files(path)).items()}


def detect_dir(path, config: dict | None = None) -> Format:
    """The format of the target directory ``path`` (its config.json and safetensors
    headers); UnsupportedFormat or ValueError (read_target_config) for what does not run."""
    path = Path(path)
    _refuse_foreign_files(path)
    config = read_target_config(path) if config is None else config
    quantized = isinstance(config.get("quantization"), dict) or "quantization_config" in config
    tensors = {} if quantized else _tensor_dtypes(path)     # a float one is told by its names
    return detect(config, tensors, path, (path / "hf_quant_config.json").is_file())


def convert_first(path, fmt: Format) -> str:
    """The one line for a ModelOpt export given where converted weights are needed."""
    return (f"{path}: {fmt} (NVIDIA's quantized layout, not MLX's): convert it once with "
            f"`mlx-dspark convert {path} -o {str(path).rstrip('/')}-mlx` and load that (a repo "
            f"id given to --model is converted on first use)")
