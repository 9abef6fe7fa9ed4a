"""A latent MoE (``moe_latent_size``) in every layout against mlx-lm's own ``nemotron_h`` on the
same weights (docs/formats.md, "Latent MoE"): the toy of testkit/latent.py saved as
Hugging Face, converted by ``mlx_lm.convert`` and exported as ModelOpt NVFP4 then converted by
``mlx-dspark convert``. Per layout: the largest logit difference relative to the largest logit,
the largest next-token log-probability difference (float32, a 20-token prompt), whether 24
greedy tokens equal mlx-lm's, and speculative decoding's tokens per round (greedy, 3 drafts, the
tokens checked equal to serial) with a drafter that proposes the target's own continuation with
probability 0.8 (testing/oracle_drafter.py) and, where the checkpoint has ``mtp.*``, the random
MTP block (useless: near 1 token per round). ``python benchmarks/bench_latent.py``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark as md  # noqa: E402
from mlx_dspark.converter import convert  # noqa: E402
from mlx_dspark.open_files import import_mlx_lm  # noqa: E402
from testkit.latent import mlx_lm_model_on, modelopt_nvfp4, save_hf  # noqa: E402
from testkit.mlx_lm_layouts import mlx_lm_convert, mlx_lm_greedy  # noqa: E402
from testkit.oracle_drafter import OracleDrafter  # noqa: E402

PROMPT = [1, 5, 9, 33, 2, 7, 8, 11, 40, 41, 42, 43, 60, 61, 3, 4, 5, 6, 7, 8]
MLX_LM = {"mlx-lm fp32": dict(dtype="float32"), "mlx-lm bf16": dict(dtype="bfloat16"),
          "mlx-lm affine 4-bit (group 32)": dict(quantize=True, q_bits=4, q_group_size=32,
                                                 dtype="bfloat16"),
          "mlx-lm nvfp4": dict(quantize=True, q_mode="nvfp4", dtype="bfloat16")}


def row(name, path, ref, mtp):
    target = md.load_target(str(path), dtype="float32")
    ids = mx.array([PROMPT])
    ours, theirs = target(ids), ref(ids)
    logit = (mx.abs(ours - theirs).max() / mx.abs(theirs).max()).item()
    lp = (mx.abs(nn_log_softmax(ours) - nn_log_softmax(theirs)).max()).item()
    serial = mlx_lm_greedy(ref, PROMPT, 24)
    pair = md.Pair(target)
    equal = md.generate(pair, PROMPT, max_tokens=24).tokens == serial
    rates = []
    drafters = [OracleDrafter(PROMPT + serial, target.config.vocab_size, acceptance=0.8,
                              target_layer_ids=(5,), seed=1)]
    if mtp:
        drafters.append(md.load_drafter("mtp", target, dtype="float32"))
    for drafter in drafters:
        spec = md.generate(md.Pair(target, drafter), PROMPT, max_tokens=24,
                           speculative="on", num_draft=3)
        assert spec.tokens == serial, name
        rates.append(f"{spec.stats.mean_tokens_per_round:.2f}")
    rates += ["-"] * (2 - len(rates))
    print(f"| {name} | {logit:.1e} | {lp:.1e} | {'yes' if equal else 'no'} | "
          f"{' | '.join(rates)} |", flush=True)


def nn_log_softmax(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def main():
    utils = import_mlx_lm("mlx_lm.utils")

    def mlx_lm_load(path):
        model, _ = utils.load_model(Path(path))
        model.set_dtype(mx.float32)
        return model

    root = Path(tempfile.mkdtemp(prefix="bench-latent-"))
    hf, _ = save_hf(root / "hf")
    print("| layout | logit error vs mlx-lm | log-prob error | greedy equal | tokens per round"
          " (0.8 drafter) | tokens per round (MTP) |\n|---|---|---|---|---|---|")
    row("Hugging Face fp32 (with mtp.*)", hf, mlx_lm_load(hf), True)
    for name, options in MLX_LM.items():
        path = mlx_lm_convert(hf, root / name.replace(" ", "-"), **options)
        row(name, path, mlx_lm_load(path), False)
    config = json.loads((hf / "config.json").read_text())
    for name, latent in (("ModelOpt NVFP4, latent projections NVFP4", True),
                         ("ModelOpt NVFP4, latent projections BF16", False)):
        export, dense = modelopt_nvfp4(hf, root / f"export-{latent}", quantize_latent=latent)
        path = convert(str(export), root / f"converted-{latent}", progress=False)
        ref = mlx_lm_model_on(config, {k: v for k, v in dense.items()
                                       if not k.startswith("mtp.")})
        row(name + " (with mtp.*)", path, ref, True)


if __name__ == "__main__":
    main()
