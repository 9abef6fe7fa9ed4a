"""The numbers docs/formats.md gives for Nemotron Omni parents (needs the omni extra):

    python benchmarks/bench_omni.py oracle          # log-prob differences against mlx-vlm
    python benchmarks/bench_omni.py memory DIR      # memory without media, then with an image

``oracle``: a tiny random Omni (testkit.omni.tiny_omni), each prompt through
mlx-dspark and through mlx-vlm's own Omni forward; the largest |log-prob difference| over every
position and at the last one. ``memory``: a random Omni with full-size towers (mlx-vlm's RADIO
v2.5-h and Parakeet defaults, the Nano Omni sizes; 1.29 G parameters, BF16) beside a toy text
tower, built into DIR once; MLX's memory after loading, after a text prompt and after a
512x512 image (the image processor's patch budget lowered to 1024 so that a shared CPU runs
RADIO in minutes)."""

from __future__ import annotations

import json
import resource
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx

import mlx_dspark as md
from mlx_dspark.checkpoint import memory
from mlx_dspark.models.media_rows import step_input, text_ids
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.omni import (PREPROCESSOR,
    audio_part,
    hf_names,
    image_part,
    png,
    tiny_omni,
    tiny_omni_config,
    tiny_tokenizer,
    user,
    vlm_inputs,
    wav)
from mlx_dspark.text.tokenizer import prompt_ids

GB = 1e9


def log_probs(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def oracle(out: Path) -> None:
    from mlx_vlm.utils import load_model
    shutil.rmtree(out, ignore_errors=True)
    path, _ = tiny_omni(out)
    pair = md.load(str(path), "none", verify="none", warm=False)
    model = load_model(path)
    for name, images, clips in [("one image 100x70", [png()], []),
                                ("two images", [png(), png(48, 90, seed=1)], []),
                                ("one image 640x480", [png(640, 480, seed=2)], []),
                                ("audio 1.3 s", [], [wav(1.3)]), ("audio 8 s", [], [wav(8)])]:
        content = [image_part(b) for b in images] + [audio_part(a) for a in clips] + \
            [{"type": "text", "text": "What is it?"}]
        ids = prompt_ids(pair.tokenizer, user(*content), True)
        marks = "<image>" * len(images) + "<so_embedding>" * len(clips)
        theirs, inputs = vlm_inputs(pair, f"<|user|>{marks}What is it?\n<|assistant|>",
                                    images, clips)
        assert text_ids(pair.target, ids) == theirs
        extra = {"pixel_values": inputs["pixel_values"]} if images else \
            {"sound_clips": inputs["sound_clips"]}
        want = log_probs(model(mx.array([theirs]), **extra).logits[0])
        t = pair.target
        got = log_probs(t.step(step_input(t, ids), t.make_cache())[0][0])
        d = mx.abs(want - got)
        print(f"{name}: {len(ids)} tokens, max |d log p| over all positions "
              f"{d.max().item():.1e}, at the last {d[-1].max().item():.1e}", flush=True)


def build(out: Path) -> None:
    from mlx.utils import tree_map
    from mlx_vlm.models.nemotron_h_nano_omni import Model, ModelConfig
    out.mkdir(parents=True)
    config = tiny_omni_config(tiny_tokenizer(out))
    config["vision_config"] = {"model_type": "radio", "args": {"register_multiple": 8}}
    config["sound_config"] = {"model_type": "parakeet"}
    config.update(vit_hidden_size=1280, projector_hidden_size=4096)
    mx.random.seed(0)
    model = Model(ModelConfig.from_dict(json.loads(json.dumps(config))))
    model.update(tree_map(lambda v: (0.02 * mx.random.normal(v.shape)).astype(mx.bfloat16)
                          if v.ndim >= 2 else v.astype(mx.bfloat16), model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), hf_names(model),
                        metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(
        {**PREPROCESSOR, "min_num_patches": 256, "max_num_patches": 1024}, indent=2))


def measure(path: Path) -> None:
    if not (path / "config.json").is_file():
        build(path)

    def rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    t = time.perf_counter()
    pair = md.load(str(path), "none", verify="none", warm=False, dtype="bfloat16")
    print(f"load: {time.perf_counter() - t:.1f} s, MLX active "
          f"{mx.get_active_memory() / GB:.3f} GB, max RSS {rss():.2f} GB; the pre-flight "
          f"counts {memory.needed_bytes(path, None, mx.bfloat16)[0] / GB:.3f} GB for text, "
          f"{memory.media_bytes(path, mx.bfloat16) / GB:.3f} GB more for the media towers",
          flush=True)
    md.generate(pair, [{"role": "user", "content": "Hello there"}], max_tokens=8)
    print(f"after a text prompt: MLX active {mx.get_active_memory() / GB:.3f} GB, max RSS "
          f"{rss():.2f} GB, towers loaded: {pair.tokenizer.media._model is not None}",
          flush=True)
    mx.reset_peak_memory()
    t = time.perf_counter()
    r = md.generate(pair, user(image_part(png(512, 512)), {"type": "text", "text": "What?"}),
                    max_tokens=8)
    print(f"after a 512x512 image ({r.stats.prompt_tokens} prompt tokens, "
          f"{time.perf_counter() - t:.0f} s): MLX active {mx.get_active_memory() / GB:.3f} GB, "
          f"peak {mx.get_peak_memory() / GB:.3f} GB, max RSS {rss():.2f} GB", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["oracle"]:
        oracle(Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/mlx-dspark-tiny-omni"))
    elif sys.argv[1:2] == ["memory"] and len(sys.argv) == 3:
        measure(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
