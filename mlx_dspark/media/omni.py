"""An Omni parent's images and audio as prompt ids, through mlx-vlm's own Nano Omni code
(``mlx_vlm.models.nemotron_h_nano_omni``: its image processor, RADIO, the ``mlp1`` projector,
Parakeet and its projection, its ``sanitize`` of the Hugging Face names), imported, never
copied. An image becomes ``<img>``, N media ids, ``</img>`` (N: its patches after the pixel
shuffle at ``downsample_ratio``); a clip ``<so_start>``, N ids, ``<so_end>``. The ids stand for
the towers' outputs (models/media_rows.py), computed on first prefill; our text tower then
reads them at those positions, and our engine decodes.

The towers' weights are read from the checkpoint's media tensors only when the first media
arrives (a text-only load never holds them), after the memory pre-flight counts them."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoint.integrity import CheckpointError
from ..checkpoint.memory import check_media_fits
from ..converter.omni import renamer
from ..models.media_rows import MediaRows
from . import parts

TOWERS = ("vision_model.", "mlp1.", "vision_final_layernorm.", "sound_encoder.",
          "sound_projection.")
MARKS = {parts.IMAGE: ("<img>", "<image>", "</img>"),
         parts.AUDIO: ("<so_start>", "<so_embedding>", "<so_end>")}


def available() -> bool:
    """Whether the ``omni`` extra (mlx-vlm) is installed."""
    try:
        import mlx_vlm.models.nemotron_h_nano_omni  # noqa: F401
    except ImportError:
        return False
    return True


def _kwargs(cls, doc: dict) -> dict:
    """The entries of a processor config that ``cls`` takes."""
    names = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in doc.items() if k in names and k not in ("self", "kwargs")}


def _read(path: Path, name: str) -> dict:
    try:
        return json.loads((path / name).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise CheckpointError(f"{path / name}: not valid JSON ({e})") from None


class _DtypeOf(nn.Module):
    """What mlx-vlm's audio path reads of the language model: its head's dtype."""

    def __init__(self, dtype):
        super().__init__()
        self.lm_head = nn.Module()
        self.lm_head.weight = mx.zeros((1,), dtype)


class OmniMedia:
    """The media path of one Omni pair: ``expand`` turns a prompt's placeholder tokens into
    media ids; the towers load on first use."""

    def __init__(self, path, target, tokenizer, allowed: str | None = None):
        from mlx_vlm.models.nemotron_h_nano_omni import (NemotronHNanoOmniImageProcessor,
                                                          NemotronHNanoOmniProcessor)
        self.path, self.target, self.allowed = Path(path), target, allowed
        self.config = _read(self.path, "config.json")
        self.ids = marks(tokenizer)
        pre = _read(self.path, "preprocessor_config.json")
        images = NemotronHNanoOmniImageProcessor(**_kwargs(NemotronHNanoOmniImageProcessor,
                                                           pre))
        self.processor = NemotronHNanoOmniProcessor(
            image_processor=images, tokenizer=tokenizer._tokenizer,
            **_kwargs(NemotronHNanoOmniProcessor, _read(self.path, "processor_config.json")))
        self._model = None
        target.media_rows = MediaRows(target.config.vocab_size)

    # --- the towers
    def towers(self):
        """mlx-vlm's Omni model holding the media towers' weights from the checkpoint (its
        language model left out: ours runs the text); made on the thread that prefills, where
        its arrays are evaluated."""
        if self._model is not None:
            return self._model
        from mlx_vlm.models.nemotron_h_nano_omni import Model, ModelConfig

        model = Model(ModelConfig.from_dict(self.config))
        rename, stored = renamer(self.path), {}
        for f in sorted(self.path.glob("*.safetensors")):
            if not f.name.startswith(("model", "media")):
                continue
            stored.update({k: v for k, v in mx.load(str(f)).items() if rename(k) is None})
        weights = model.sanitize(stored)
        want = {k for k, _ in tree_flatten(model.parameters()) if k.startswith(TOWERS)}
        missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
        if missing or extra:
            name, what = (missing[0], "missing from") if missing else (extra[0], "unknown to")
            raise CheckpointError(f"{self.path}: media tensor {name} {what} the checkpoint's "
                                  f"vision and audio towers ({len(missing)} missing, "
                                  f"{len(extra)} unknown)")
        model.language_model = _DtypeOf(self.target.dtype)
        model.load_weights(list(weights.items()), strict=False)
        model.eval()                    # BatchNorm from its running statistics
        self._model = model
        return model

    # --- ids
    def _image(self, media: parts.Media):
        # On the thread that encodes the prompt (a server's worker), not the engine's: the
        # processor's resize runs on the CPU stream, so no GPU stream crosses threads.
        with mx.stream(mx.cpu):
            out = self.processor.image_processor(images=[media.decoded])
        pixels, n = out["pixel_values"], int(out["num_tokens"][0])

        def rows():
            return self.towers().extract_feature(mx.array(pixels)).reshape(n, -1)
        return n, rows

    def _audio(self, media: parts.Media):
        clips, counts = self.processor._process_audio([media.decoded], {})
        n = int(counts[0])

        def rows():
            features = self.towers()._extract_sound_features(sound_clips=clips)
            return features.reshape(-1, features.shape[-1])[:n]
        return n, rows

    def expand(self, ids: list[int], media: list[parts.Media]) -> list[int]:
        """``ids`` (the chat template's, one placeholder token per media part, in order) with
        each placeholder replaced by its start mark, its media ids and its end mark."""
        table = self.target.media_rows
        if self._model is None:         # refused here, before the engine would load them
            check_media_fits(self.path, self.target.dtype)
        out, k = [], 0
        holders = {self.ids[MARKS[kind][1]]: kind for kind in MARKS}
        for t in ids:
            kind = holders.get(t)
            if kind is None:
                out.append(t)
                continue
            if k >= len(media) or media[k].kind != kind:
                where = media[min(k, len(media) - 1)].where
                raise parts.MediaError(where, f"the chat template's text holds a "
                                              f"{MARKS[kind][1]} where no {kind} part is")
            key = f"{media[k].key}:{self.processor.image_processor.max_num_patches}"
            ids = table.held(key)       # seen before (an earlier request, a shorter render)
            if ids is None:
                item = parts.decode(media[k])
                n, rows = (self._image if kind == parts.IMAGE else self._audio)(item)
                ids = table.register(key, n, t, rows)
            out += [self.ids[MARKS[kind][0]], *ids, self.ids[MARKS[kind][2]]]
            k += 1
        if k != len(media):
            raise parts.MediaError(media[k].where, "the chat template dropped this part's "
                                                   "placeholder (its message is not rendered)")
        return out


def marks(tokenizer) -> dict | None:
    """The ids of the media placeholders' tokens, or None when the tokenizer lacks one."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for m in MARKS.values() for t in m}
    return None if any(i in (None, tokenizer.unk_token_id) for i in ids.values()) else ids


def attach(pair, allowed: str | None = None) -> None:
    """Give an Omni pair its media path (the tokenizer's ``media`` encoder) when the extra is
    installed; a pair that is not an Omni parent (or whose tokenizer has no media
    placeholders), or without the extra, keeps none: it reads text only."""
    from ..converter.omni import is_wrapper_dir
    if pair.tokenizer is None or not is_wrapper_dir(pair.path) or not available() \
            or marks(pair.tokenizer) is None:
        return
    pair.tokenizer.media = OmniMedia(pair.path, pair.target, pair.tokenizer,
                                     None if allowed is None else os.fspath(allowed))
