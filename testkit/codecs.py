"""The number formats and files of a ModelOpt export, in NumPy only, for the synthetic
checkpoints (synthetic.py): E2M1 codes, the E4M3 codec, an NVFP4/FP8 quantizer (per-tensor
``weight_scale_2 = amax / (6·448)``, two codes per byte, even element in the low nibble) and a
raw safetensors writer and reader. Independent of the converter on purpose: it is what the
converter's output is checked against."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E4M3_MAX = 448.0


def e4m3_table() -> np.ndarray:
    """float32 value of every E4M3 byte (bias 7, no infinities, 0x7F/0xFF are NaN)."""
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    val = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    val = np.where((b & 0x7F) == 0x7F, np.nan, sign * val)
    return val.astype(np.float32)


E4M3 = e4m3_table()


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Round to the nearest E4M3 value (ties to the even code), saturating at 448."""
    x = np.asarray(x, np.float64)
    mags = E4M3[:127].astype(np.float64)                  # codes 0..126, increasing
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(mags, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    return (code | np.where(x < 0, 0x80, 0)).astype(np.uint8)


def bf16_bytes(x: np.ndarray) -> bytes:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def nvfp4_quantize(w: np.ndarray):
    """ModelOpt-style NVFP4: returns (packed uint8 (out, in/2), E4M3 scale bytes (out, in/16),
    float32 weight_scale_2)."""
    w = np.asarray(w, np.float32)
    out, n = w.shape
    ws2 = np.float32(np.abs(w).max() / (6 * E4M3_MAX))
    blocks = w.reshape(out, n // 16, 16)
    scale = e4m3_encode(np.abs(blocks).max(-1) / (6 * ws2))
    denom = (E4M3[scale] * ws2)[..., None]
    scaled = np.divide(blocks, denom, out=np.zeros_like(blocks), where=denom > 0)
    mag = np.abs(E2M1[:8])
    code = np.abs(np.abs(scaled)[..., None] - mag).argmin(-1)
    code = (code | np.where(np.signbit(scaled), 8, 0)).reshape(out, n).astype(np.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), scale, ws2


def nvfp4_dequantize(packed, scale, ws2) -> np.ndarray:
    """ModelOpt's formula: e2m1(code) · (float(block scale) · weight_scale_2), fp32."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    s = (E4M3[np.asarray(scale, np.uint8)] * np.float32(ws2)).astype(np.float32)
    return E2M1[codes] * np.repeat(s, 16, axis=-1)


def fp8_quantize(w: np.ndarray):
    w = np.asarray(w, np.float32)
    scale = np.float32(np.abs(w).max() / E4M3_MAX)
    return e4m3_encode(w / scale), scale


# ---------------------------------------------------------------- raw safetensors


def write_raw_safetensors(path: Path, tensors: dict, metadata=None) -> None:
    """``tensors``: name -> (dtype, shape, bytes), written in the dict's order."""
    header, off = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in tensors.values():
            f.write(data)


def read_raw_safetensors(path: Path) -> dict:
    """name -> (dtype, shape, bytes) for every tensor of one file."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], tuple(v["shape"]), blob[base + v["data_offsets"][0]:
                                                    base + v["data_offsets"][1]])
            for k, v in header.items()}


def read_raw_checkpoint(src: Path) -> dict:
    out = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        out.update(read_raw_safetensors(f))
    return out
