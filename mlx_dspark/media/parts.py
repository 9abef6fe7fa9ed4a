"""Images and audio in chat messages: the content parts that carry them, in every shape the
server takes (OpenAI ``image_url`` and ``input_audio``, Anthropic base64 ``image``, Responses
``input_image``), read into :class:`Media` (the bytes, checked against :data:`LIMITS`) in the
order they come, and the messages with each part replaced by the checkpoint's placeholder
text. Every refusal is a :class:`MediaError` naming the part (``messages[i].content[j]``).

Sources: data URLs and base64 only; ``file://`` URLs only under a directory the caller names
(``--allowed-local-media-path``); never a remote fetch. Decoding needs the ``omni`` extra
(Pillow, miniaudio, both brought by mlx-vlm), imported on first use."""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import io
import os
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from ..request import RequestError

INSTALL = "pip install 'mlx-dspark[omni]'"
IMAGE, AUDIO = "image", "audio"
PLACEHOLDER = {IMAGE: "<image>", AUDIO: "<so_embedding>"}
"""The text each part becomes before the chat template (mlx-vlm's processor expands it)."""


@dataclass(frozen=True)
class Limits:
    bytes: int = 20 << 20              # one part, decoded
    images: int = 8                    # per request
    side: int = 8192                   # pixels, either side, as the image's header declares
    audios: int = 4                    # per request
    seconds: float = 300.0             # one clip
    rate: int = 16000                  # what the audio tower hears (Parakeet)


LIMITS = Limits()
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def why_no_media() -> str:
    """Why a pair without a media path refuses a media part."""
    if importlib.util.find_spec("mlx_vlm") is None:
        return f"images and audio need the omni extra: {INSTALL} (and a Nemotron Omni model)"
    return "this model reads text only: images and audio need a Nemotron Omni checkpoint"


class MediaError(RequestError):
    """A media part that cannot be used; ``param`` is its JSON path."""

    def __init__(self, where: str, message: str):
        super().__init__(where, f"{where}: {message}")


@dataclass
class Media:
    """One image or audio clip: its bytes, where it came from in the request, and once
    decoded, the image (PIL) or the waveform (16 kHz float32)."""
    kind: str
    data: bytes = field(repr=False)
    where: str
    format: str = ""
    decoded: object = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return f"{self.kind}:{hashlib.sha256(self.data).hexdigest()}"


def _b64(text, where: str) -> bytes:
    if not isinstance(text, str):
        raise MediaError(where, "base64 data must be a string")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(where, "not valid base64") from None
    if not data:
        raise MediaError(where, "empty media data")
    return data


def _url(url, where: str, allowed: str | None) -> bytes:
    """The bytes a data URL holds, or a local file's under ``allowed``."""
    if not isinstance(url, str):
        raise MediaError(where, "the URL must be a string")
    if url.startswith("data:"):
        head, comma, body = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise MediaError(where, "a data URL must be base64 (data:image/png;base64,...)")
        return _b64(body, where)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if allowed is None:
            raise MediaError(where, "file:// URLs are read only under the directory the server "
                                    "names (--allowed-local-media-path DIR); send a data URL")
        path = os.path.realpath(unquote(parsed.path))
        root = os.path.realpath(allowed)
        if os.path.commonpath([path, root]) != root:
            raise MediaError(where, f"{unquote(parsed.path)} is outside the allowed media "
                                    f"directory {allowed}")
        try:
            if os.path.getsize(path) > LIMITS.bytes:
                raise MediaError(where, f"the file is over {LIMITS.bytes >> 20} MB")
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise MediaError(where, f"cannot read {unquote(parsed.path)} "
                                    f"({e.strerror or e})") from None
    raise MediaError(where, f"{parsed.scheme or 'this'} URLs are never fetched; send the "
                            f"media inline as a data URL (data:image/png;base64,...)")


def _part(part: dict, where: str, allowed: str | None) -> Media | None:
    """The media of a content part (None for a text part)."""
    kind = part.get("type")
    if kind == "image_url":             # OpenAI chat: {"image_url": {"url": ...}} or a string
        url = part.get("image_url")
        return Media(IMAGE, _url(url.get("url") if isinstance(url, dict) else url, where,
                                 allowed), where)
    if kind == "input_image":           # Responses: {"image_url": "data:..."}
        if part.get("file_id") is not None:
            raise MediaError(where, "file_id images need an uploaded file store; send "
                                    "image_url as a data URL")
        return Media(IMAGE, _url(part.get("image_url"), where, allowed), where)
    if kind == "image":                 # Anthropic: {"source": {"type": "base64", ...}}
        source = part.get("source")
        if not isinstance(source, dict) or source.get("type") != "base64":
            raise MediaError(where, "only base64 image sources are read "
                                    "({\"type\": \"base64\", \"media_type\": ..., \"data\": ...})"
                                    "; URLs are never fetched")
        return Media(IMAGE, _b64(source.get("data"), where), where)
    if kind == "input_audio":           # OpenAI: {"input_audio": {"data": b64, "format": ...}}
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise MediaError(where, "input_audio must be an object with data and format")
        fmt = str(audio.get("format", "")).lower()
        if fmt not in AUDIO_FORMATS:
            raise MediaError(where, f"audio format {audio.get('format')!r}: one of "
                                    f"{', '.join(AUDIO_FORMATS)}")
        return Media(AUDIO, _b64(audio.get("data"), where), where, fmt)
    return None


MEDIA_TYPES = ("image_url", "input_image", "image", "input_audio")


def is_media(part) -> bool:
    return isinstance(part, dict) and part.get("type") in MEDIA_TYPES


def located(part: dict, where: str) -> dict:
    """A media part that carries its path in the request (a protocol's reader renumbers
    messages: a refusal still names the part as the client sent it)."""
    return {**part, "where": where}


def content(pieces: list):
    """A message's content from its pieces in order (text strings, :func:`located` media
    parts): the text joined when there is no media part, else the parts."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces]


def has_media(messages) -> bool:
    """Whether any message has a media part (cheap: the parts are not read)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in MEDIA_TYPES for p in m["content"])
        for m in messages)


def first_media(messages) -> str:
    """The path of the first media part (for a refusal that names it)."""
    for i, m in enumerate(messages):
        for j, p in enumerate(m.get("content") if isinstance(m.get("content"), list) else ()):
            if isinstance(p, dict) and p.get("type") in MEDIA_TYPES:
                return p.get("where") or f"messages[{i}].content[{j}]"
    return "messages"


def split(messages: list[dict], allowed: str | None = None) -> tuple[list[dict], list[Media]]:
    """The messages with each media part as its placeholder text (content lists with media
    become strings, in the parts' order), and the media in order. A part may carry its own
    path as ``where`` (a protocol reader that renumbered messages)."""
    out, media = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(
                isinstance(p, dict) and p.get("type") in MEDIA_TYPES for p in content):
            out.append(m)
            continue
        text = []
        for j, p in enumerate(content):
            where = (p.get("where") if isinstance(p, dict) else None) \
                or f"messages[{i}].content[{j}]"
            item = _part(p, where, allowed) if isinstance(p, dict) else None
            if item is not None:
                media.append(item)
                text.append(PLACEHOLDER[item.kind])
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                if any(t in p["text"] for t in PLACEHOLDER.values()):
                    raise MediaError(where, f"text with a media placeholder "
                                            f"({' or '.join(PLACEHOLDER.values())}) beside "
                                            f"media parts; send the media as parts only")
                text.append(p["text"])
            else:
                raise MediaError(where, "a content part must be text, an image or audio")
        out.append({**m, "content": "".join(text)})
    count = {k: sum(x.kind == k for x in media) for k in (IMAGE, AUDIO)}
    for kind, most in ((IMAGE, LIMITS.images), (AUDIO, LIMITS.audios)):
        if count[kind] > most:
            extra = [x for x in media if x.kind == kind][most]
            raise MediaError(extra.where, f"more than {most} {kind}s in one request")
    for x in media:
        if len(x.data) > LIMITS.bytes:
            raise MediaError(x.where, f"{len(x.data) >> 20} MB, over the "
                                      f"{LIMITS.bytes >> 20} MB a media part may have")
    return out, media


def decode(media: Media) -> Media:
    """``media`` with its image opened and checked (format, declared size, every byte
    there) or its audio decoded to 16 kHz mono float32 (length checked first)."""
    if media.decoded is not None:
        return media
    media.decoded = (_image if media.kind == IMAGE else _audio)(media)
    return media


def _image(media: Media):
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise MediaError(media.where, f"images need the omni extra: {INSTALL}") from None
    try:
        img = Image.open(io.BytesIO(media.data))
    except UnidentifiedImageError:
        raise MediaError(media.where, "not an image (PNG, JPEG, WebP, GIF or BMP)") from None
    except Image.DecompressionBombError:
        raise MediaError(media.where, f"the image declares over {2 * Image.MAX_IMAGE_PIXELS} "
                                      f"pixels; at most {LIMITS.side} on a side") from None
    if img.format not in IMAGE_FORMATS:
        raise MediaError(media.where, f"{img.format} images are not read; send PNG, JPEG, "
                                      f"WebP, GIF or BMP")
    w, h = img.size
    if max(w, h) > LIMITS.side or min(w, h) < 1:
        raise MediaError(media.where, f"the image declares {w}x{h} pixels; at most "
                                      f"{LIMITS.side} on a side")
    try:
        img.load()                      # every byte read now: a truncated file fails here
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(media.where, f"a broken {img.format} image ({e})") from None
    return img.convert("RGB")


def _audio(media: Media):
    try:
        import miniaudio
        import numpy as np
    except ImportError:
        raise MediaError(media.where, f"audio needs the omni extra: {INSTALL}") from None
    info = {"wav": miniaudio.wav_get_info, "mp3": miniaudio.mp3_get_info,
            "flac": miniaudio.flac_get_info, "ogg": miniaudio.vorbis_get_info}[media.format]
    try:
        head = info(media.data)
        seconds = head.num_frames / max(head.sample_rate, 1)
        if seconds > LIMITS.seconds:
            raise MediaError(media.where, f"{seconds:.0f} s of audio; at most "
                                          f"{LIMITS.seconds:.0f} s a clip")
        sound = miniaudio.decode(media.data, output_format=miniaudio.SampleFormat.FLOAT32,
                                 nchannels=1, sample_rate=LIMITS.rate)
    except miniaudio.DecodeError as e:
        raise MediaError(media.where, f"not {media.format} audio ({e})") from None
    wave = np.frombuffer(sound.samples, dtype=np.float32).copy()
    if not wave.size:
        raise MediaError(media.where, "an audio clip without samples")
    return wave
