"""mlx-lm's Nemotron-H layout, the files ``mlx_lm.convert`` writes, read as they are.

The differences from the converted layout (ARCHITECTURE.md) are names and containers, never
values: routed experts are stacked under ``mixer.switch_mlp.fc1`` / ``fc2`` (our
``experts.up_proj`` / ``down_proj``), conv1d weights are ``(C, K, 1)``, and quantized modules
(embedding and lm_head included) hold MLX's own ``weight`` / ``scales`` [/ ``biases``] with the
scheme in ``config.json``'s ``quantization``: defaults, per-module overrides (a dict, or False
for a module left in float), and for unlisted modules with scales the scheme their shapes
imply, all as ``mlx_lm.utils.load_model`` decides. Quantized modules become MLX's layers
(``nn.QuantizedLinear``, ``nn.QuantizedEmbedding``) and ``mx.gather_qmm`` for experts, called
as mlx-lm calls them; float scales and biases take the compute dtype, as mlx-lm's model in
that dtype holds them. Every tensor of the files must be used (mlx-lm loads strictly)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.integrity import CheckpointError
from ..device import on_gpu
from .quant import DenseExperts, Weights, expert_compute_dtype, make_linear

EXPERT_NAMES = {".experts.up_proj": ".switch_mlp.fc1", ".experts.down_proj": ".switch_mlp.fc2"}
_FIXED_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
_QUANT_SUFFIXES = (".weight", ".scales", ".biases", ".bias", ".global_scale")


def mlx_lm_name(prefix: str) -> str:
    """Our module name -> mlx-lm's."""
    for ours, theirs in EXPERT_NAMES.items():
        if prefix.endswith(ours):
            return prefix[:-len(ours)] + theirs
    return prefix


def in_features(cfg, prefix: str) -> int:
    """The input width of the linear module ``prefix`` (our names), from the config."""
    last = prefix.rsplit(".", 1)[-1]
    if last == "out_proj":
        return cfg.mamba_num_heads * cfg.mamba_head_dim
    if last == "o_proj":
        return cfg.num_attention_heads * (cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)
    if last == "down_proj":
        return (cfg.moe_shared_expert_intermediate_size if ".shared_experts." in prefix else
                cfg.moe_intermediate_size if ".experts." in prefix else cfg.intermediate_size)
    if last == "fc2_latent_proj" or prefix.endswith(".experts.up_proj") and cfg.moe_latent_size:
        return cfg.moe_latent_size          # a latent MoE's experts read the latent
    return cfg.hidden_size


def quant_params(quantization: dict, name: str, tensors: dict, in_dims: int) -> dict | None:
    """How mlx-lm quantizes module ``name``: its entry in ``quantization`` when it has one,
    else, when the files hold its scales, what their shapes imply (mlx_lm.utils.
    infer_quant_config: affine keeps float scales; each other mode has one (bits, group));
    None for a float module."""
    if name in quantization:
        entry = quantization[name]
        if entry is True:                   # mlx-lm: quantized with the defaults
            entry = {k: quantization[k] for k in ("group_size", "bits", "mode")
                     if k in quantization}
        return dict(entry) if entry else None
    scales = tensors.get(f"{name}.scales")
    if scales is None:
        return None
    group = in_dims // scales.shape[-1]
    bits = tensors[f"{name}.weight"].shape[-1] * 32 // in_dims
    if scales.dtype != mx.uint8:
        return {"group_size": group, "bits": bits, "mode": "affine"}
    if (bits, group) not in _FIXED_MODES:
        raise CheckpointError(f"{name}: cannot tell its quantization ({bits} bits in groups of "
                              f"{group} with uint8 scales is no MLX mode)")
    return {"group_size": group, "bits": bits, "mode": _FIXED_MODES[(bits, group)]}


class QuantizedExperts(nn.Module):
    """Stacked experts in an MLX quantization: ``mx.gather_qmm`` as mlx-lm's
    ``QuantizedSwitchLinear`` calls it, in the experts' compute dtype (quant.
    expert_compute_dtype); ``layer(x, idx)`` as quant.py's experts."""

    def __init__(self, tensors: dict, params: dict, compute_dtype):
        super().__init__()
        self.group_size, self.bits = params["group_size"], params["bits"]
        self.mode = params.get("mode", "affine")
        self.compute_dtype = compute_dtype
        for name, v in tensors.items():
            setattr(self, name, v)

    def __call__(self, x, idx, sorted_indices=False):
        y = mx.gather_qmm(x.astype(self.compute_dtype), self["weight"], self["scales"],
                          self.get("biases"), rhs_indices=idx, transpose=True,
                          group_size=self.group_size, bits=self.bits, mode=self.mode,
                          global_scale=self.get("global_scale"), sorted_indices=sorted_indices)
        return y.astype(x.dtype)


@dataclass(frozen=True)
class MlxLmWeights(Weights):
    """:class:`~mlx_dspark.models.quant.Weights` over mlx-lm's files: the model asks for our
    names; linears, experts and the embedding are built from mlx-lm's tensors and scheme.
    ``used`` collects every tensor handed out, for :meth:`check_all_used`."""

    config: object = None
    quantization: dict = field(default_factory=dict)
    used: set = field(default_factory=set)

    def __getitem__(self, name: str) -> mx.array:
        self.used.add(name)
        return self.tensors[name]

    def get(self, name: str, default=None):
        return self[name] if name in self.tensors else default

    def cast(self, name: str) -> mx.array:
        return self[name].astype(self.dtype)

    def _module(self, prefix: str, in_dims: int) -> tuple[str, dict | None, dict]:
        """mlx-lm's name for ``prefix``, its scheme (None: float) and its tensors."""
        name = mlx_lm_name(prefix)
        params = quant_params(self.quantization, name, self.tensors, in_dims)
        found = {s[1:]: self[name + s] for s in _QUANT_SUFFIXES if name + s in self.tensors}
        if "weight" not in found:
            raise KeyError(f"{name}.weight")
        if params is not None:
            g, bits = params["group_size"], params["bits"]
            want = (in_dims * bits // 32, in_dims // g)
            got = (found["weight"].shape[-1], found.get("scales", found["weight"]).shape[-1])
            if "scales" not in found or got != want:
                raise CheckpointError(f"{name}: weight/scales {got[0]}/{got[1]} columns, "
                                      f"expected {want[0]}/{want[1]} for {in_dims} inputs "
                                      f"at {bits} bits in groups of {g}")
            for k in ("scales", "biases"):     # float scales in the compute dtype, as mlx-lm
                if k in found and found[k].dtype != mx.uint8:
                    found[k] = found[k].astype(self.dtype)
        return name, params, found

    def linear(self, prefix: str, dtype=None) -> nn.Module:
        name, params, found = self._module(prefix, in_features(self.config, prefix))
        if params is None:
            return make_linear({f"{name}.{k}": v for k, v in found.items()}, name,
                               dtype or self.dtype)
        w = found["weight"]
        layer = nn.QuantizedLinear(in_features(self.config, prefix), w.shape[0],
                                   bias="bias" in found, **params)
        layer.update(found)
        return layer

    def experts(self, prefix: str) -> nn.Module:
        name, params, found = self._module(prefix, in_features(self.config, prefix))
        cdt = expert_compute_dtype(self.dtype)
        if params is None:
            return DenseExperts(found["weight"].astype(cdt))
        if "global_scale" in found and not on_gpu():
            raise CheckpointError(f"{name}: per-expert nvfp4 global scales run on the GPU only "
                                  f"(MLX's gather_qmm); re-convert without them")
        return QuantizedExperts(found, params, cdt)

    def embedding(self, prefix: str):
        name, params, found = self._module(prefix, self.config.hidden_size)
        if params is None:
            return found["weight"]          # kept as stored, like the converted layout's
        layer = nn.QuantizedEmbedding(found["weight"].shape[0], self.config.hidden_size,
                                      **params)
        layer.update(found)
        return layer

    def check_all_used(self, path) -> None:
        """mlx-lm loads strictly: a tensor no module took means a model this is not."""
        extra = sorted(n for n in set(self.tensors) - self.used if not n.startswith("mtp."))
        if extra:
            raise CheckpointError(f"{path}: tensors that mlx-lm's Nemotron-H does not have: "
                                  f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")


def mlx_lm_weights(tensors: dict, raw: dict, cfg, dtype) -> MlxLmWeights:
    """The tensors of an mlx-lm-layout directory (config ``raw``, parsed ``cfg``)."""
    quantization = raw.get("quantization") or {}
    return MlxLmWeights(tensors, dtype, None, cfg, quantization)
