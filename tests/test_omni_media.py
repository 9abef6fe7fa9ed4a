"""Images and audio into a Nemotron Omni parent through mlx-vlm (issue 40.2). The oracle is
mlx-vlm's own Omni forward on a tiny random checkpoint built with mlx-vlm's model class and
saved in the Hugging Face layout (testkit/omni.py): the same prompt ids, next-token
log-probabilities within 1e-3, the same greedy tokens. Speculation stays exact after a media
prompt; the prompt cache reuses a prompt through the same image and nothing from a different
one on; bad media are refused naming the part. Skipped without the ``omni`` extra, except the
refusal of media parts by a pair that has no media path (tests/test_omni.py, which runs
without it)."""

from __future__ import annotations

import base64

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.media import parts
from mlx_dspark.media.parts import MediaError
from mlx_dspark.models.media_rows import step_input, text_ids
from testkit.omni import audio_part, image_part, png, png_header, user, vlm_inputs, wav
from mlx_dspark.text.tokenizer import prompt_ids


vlm = pytest.importorskip("mlx_vlm.models.nemotron_h_nano_omni", exc_type=ImportError,
                          reason="the omni extra (mlx-vlm) is not installed")


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from testkit.omni import tiny_omni
    return tiny_omni(tmp_path_factory.mktemp("omni") / "tiny")


@pytest.fixture(scope="module")
def pair(omni):
    return md.load(str(omni[0]), "none", verify="none", warm=False)


def _log_probs(logits) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_the_tiny_checkpoint_loads_back_in_mlx_vlm_bit_for_bit(omni):
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model
    path, made = omni
    back = dict(tree_flatten(load_model(path).parameters()))
    mine = dict(tree_flatten(made.parameters()))
    assert set(back) == set(mine)
    assert all(back[k].dtype == v.dtype and mx.array_equal(back[k], v).item()
               for k, v in mine.items())


@pytest.mark.parametrize("kind", ["image", "two images", "audio"])
def test_log_probs_and_greedy_tokens_equal_mlx_vlms_omni_forward(omni, pair, kind):
    from mlx_vlm.utils import load_model
    images = {"image": [png()], "two images": [png(), png(48, 90, seed=1)], "audio": []}[kind]
    clips = [wav(1.3)] if kind == "audio" else []
    content = [image_part(b) for b in images] + [audio_part(a) for a in clips] + \
        [{"type": "text", "text": "What is it?"}]
    ids = prompt_ids(pair.tokenizer, user(*content), True)
    marks = "".join(["<image>"] * len(images) + ["<so_embedding>"] * len(clips))
    theirs, inputs = vlm_inputs(pair, f"<|user|>{marks}What is it?\n<|assistant|>",
                                 images, clips)
    assert text_ids(pair.target, ids) == theirs and max(ids) >= pair.target.config.vocab_size
    model = load_model(omni[0])
    extra = {"pixel_values": inputs["pixel_values"]} if images else \
        {"sound_clips": inputs["sound_clips"]}
    want = _log_probs(model(mx.array([theirs]), **extra).logits[0])
    target = pair.target
    got = _log_probs(target.step(step_input(target, ids), target.make_cache())[0][0])
    assert mx.abs(want - got).max().item() < 1e-3
    greedy, tokens = list(theirs), []
    for _ in range(10):
        tokens.append(mx.argmax(model(mx.array([greedy]), **extra).logits[0, -1]).item())
        greedy.append(tokens[-1])
    result = md.generate(pair, user(*content), max_tokens=10, temperature=0, chat=True)
    assert result.tokens == tokens[:len(result.tokens)]
    assert len(result.tokens) == len(tokens) or result.stats.finish_reason == "stop"


@pytest.mark.parametrize("drafter", ["dspark", "eagle3", "mtp"])
def test_speculation_stays_exact_after_a_media_prompt(omni, drafter):
    from dataclasses import replace
    from testkit import toy
    base = md.load(str(omni[0]), "none", verify="none", warm=False)
    made = {"dspark": lambda t: toy.random_drafter(t, tap_layers=(0, 2)),
            "eagle3": lambda t: toy.random_eagle3(t, aux=(0, 2, 3), own_embedding=True),
            "mtp": lambda t: toy.random_mtp(t)}[drafter](base.target)
    pair = replace(base, drafter=made)
    messages = user(image_part(png()), audio_part(wav(0.8)), {"type": "text", "text": "Say."})
    spec = md.generate(pair, messages, max_tokens=16, speculative="on", temperature=0)
    serial = md.generate(pair, messages, max_tokens=16, speculative="off", temperature=0)
    assert spec.tokens == serial.tokens and spec.stats.rounds > 0


def test_the_prompt_cache_keys_media_by_content(omni, tmp_path):
    pair = md.load(str(omni[0]), "none", warm=False, prompt_cache_dir=tmp_path / "cache")

    def asking(image):
        return [{"role": "system", "content": "You look at pictures."}] + \
            user({"type": "text", "text": "Look: "}, image_part(image))
    a, b = png(seed=3), png(seed=4)
    ids = prompt_ids(pair.tokenizer, asking(a), True)
    media = [i for i, t in enumerate(ids) if t >= pair.target.config.vocab_size]
    first = md.generate(pair, asking(a), max_tokens=4, temperature=0)
    again = md.generate(pair, asking(a), max_tokens=4, temperature=0)
    other = md.generate(pair, asking(b), max_tokens=4, temperature=0)
    assert first.stats.reused_tokens == 0
    assert again.stats.reused_tokens > media[-1] and again.tokens == first.tokens
    assert 0 < other.stats.reused_tokens <= media[0]         # the system message, no more
    on_disk = pair.prompt_cache.store.entries.values()           # media ids: memory only
    assert on_disk and all(max(e.tokens) < pair.target.config.vocab_size for e in on_disk)


BAD = {
    "truncated": (lambda: image_part(png()[:-40]), "a broken PNG image"),
    "not an image": (lambda: image_part(b"GIF89a but not really" * 10), "not an image"),
    "20000x20000": (lambda: image_part(png_header(20000, 20000)),
                    "pixels; at most 8192 on a side"),
    "9000x100": (lambda: image_part(png_header(9000, 100)),
                 "declares 9000x100 pixels; at most 8192 on a side"),
    "remote URL": (lambda: {"type": "image_url",
                            "image_url": {"url": "https://example.com/cat.png"}},
                   "https URLs are never fetched"),
    "file URL": (lambda: {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                 "file:// URLs are read only under the directory the server names"),
    "bad base64": (lambda: {"type": "input_audio",
                            "input_audio": {"data": "@@@", "format": "wav"}},
                   "not valid base64"),
    "long audio": (lambda: audio_part(wav(301, rate=2000)), "301 s of audio; at most 300 s"),
    "not audio": (lambda: audio_part(b"RIFF" + b"\0" * 200), "not wav audio"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_media_is_refused_naming_the_part(pair, case):
    make, words = BAD[case]
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, make()]}]
    with pytest.raises(MediaError) as e:
        prompt_ids(pair.tokenizer, messages, True)
    assert e.value.param == "messages[1].content[1]"
    assert str(e.value).startswith("messages[1].content[1]: ") and words in str(e.value)


def test_too_many_images_names_the_first_one_over(pair):
    messages = user(*[image_part(png(seed=i)) for i in range(parts.LIMITS.images + 1)])
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[8\]: more than 8 images"):
        prompt_ids(pair.tokenizer, messages, True)


def test_local_files_only_under_the_allowed_directory(omni, tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(png())
    (tmp_path / "elsewhere.png").write_bytes(png())
    pair = md.load(str(omni[0]), "none", verify="none", warm=False,
                   allowed_local_media_path=tmp_path / "ok")
    ok = prompt_ids(pair.tokenizer, user({"type": "image_url", "image_url": {
        "url": f"file://{tmp_path}/ok/a.png"}}), True)
    assert ok == prompt_ids(pair.tokenizer, user(image_part(png())), True)
    with pytest.raises(MediaError, match="outside the allowed media directory"):
        prompt_ids(pair.tokenizer, user({"type": "image_url", "image_url": {
            "url": f"file://{tmp_path}/ok/../elsewhere.png"}}), True)


def test_the_towers_load_only_when_media_arrive(omni):
    from mlx.utils import tree_flatten
    from mlx_dspark.checkpoint import memory
    pair = md.load(str(omni[0]), "none", verify="none", warm=False)
    assert pair.tokenizer.media._model is None
    md.generate(pair, "<|user|>hi\n<|assistant|>", max_tokens=2)
    assert pair.tokenizer.media._model is None
    md.generate(pair, user(image_part(png()), {"type": "text", "text": "x"}), max_tokens=2)
    towers = pair.tokenizer.media._model
    held = sum(v.nbytes for k, v in tree_flatten(towers.parameters())
               if k.startswith(("vision_model.", "mlp1.", "sound_")))
    estimate = memory.media_bytes(omni[0], pair.target.dtype)   # what the pre-flight counts
    assert held <= estimate <= held + 1024           # (a dropped feature-extractor buffer)


# -- the command line and the server ----------------------------------------------------------

def test_generate_takes_images_and_audio_files(omni, pair, tmp_path, capsys):
    from mlx_dspark import cli
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "b.wav").write_bytes(wav(0.7))
    base = ["generate", "--model", str(omni[0]), "--drafter", "none", "--verify", "none",
            "-p", "What?", "-m", "6", "--temp", "0"]
    assert cli.main(base + ["--image", str(tmp_path / "a.png"),
                            "--audio", str(tmp_path / "b.wav")]) == 0
    want = md.generate(pair, user(image_part(png()), audio_part(wav(0.7)),
                                  {"type": "text", "text": "What?"}), max_tokens=6,
                       temperature=0)
    assert capsys.readouterr().out == want.text + "\n"
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    assert cli.main(base + ["--image", str(tmp_path / "a.png"),
                            "--image", str(tmp_path / "bad.png")]) == 1
    err = capsys.readouterr().err
    assert err == (f"mlx-dspark generate: error: --image {tmp_path / 'bad.png'}: not an image "
                   f"(PNG, JPEG, WebP, GIF or BMP)\n")


@pytest.fixture(scope="module")
def client(omni, tmp_path_factory):
    from testkit.server_helpers import app_client, started_engine
    allowed = tmp_path_factory.mktemp("media")
    (allowed / "a.png").write_bytes(png())
    for engine in started_engine(lambda: md.load(str(omni[0]), "none", verify="none",
                                                 warm=False, allowed_local_media_path=allowed),
                                 max_batch=2):
        yield app_client(engine, "omni"), allowed


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_the_server_reads_media_in_every_protocols_shape(client):
    c, allowed = client
    chat = c.post("/v1/chat/completions", json={"model": "omni", "max_tokens": 5,
                                                "temperature": 0, "messages": user(
        {"type": "text", "text": "What?"}, image_part(png()), audio_part(wav(0.5)))})
    assert chat.status_code == 200, chat.text
    local = c.post("/v1/chat/completions", json={"model": "omni", "max_tokens": 5,
                                                 "temperature": 0, "messages": user(
        {"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {
            "url": f"file://{allowed}/a.png"}}, audio_part(wav(0.5)))})
    assert local.json()["choices"] == chat.json()["choices"]     # the same bytes, read there
    claude = c.post("/v1/messages", json={"model": "omni", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": _b64(png())}},
            {"type": "text", "text": "What?"}]}]})
    assert claude.status_code == 200, claude.text
    responses = c.post("/v1/responses", json={"model": "omni", "max_output_tokens": 5,
                                              "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What?"},
        {"type": "input_image", "image_url": "data:image/png;base64," + _b64(png())}]}]})
    assert responses.status_code == 200, responses.text


@pytest.mark.parametrize("path,body,where", [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s"}] + user(
        {"type": "text", "text": "x"}, image_part(png()[:-40]))}, "messages[1].content[1]"),
    ("/v1/messages", {"system": "s", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": _b64(png_header(20000, 20000))}}]}]},
     "messages[0].content[1]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,"
                                             + _b64(b"plain text")}]}]}, "input[0].content[0]"),
    ("/v1/chat/completions", {"messages": user(*[image_part(png(seed=i)) for i in range(9)])},
     "messages[0].content[8]"),
    ("/v1/chat/completions", {"messages": user(audio_part(wav(301, rate=2000)))},
     "messages[0].content[0]"),
])
def test_bad_media_is_a_400_naming_the_part_and_the_server_keeps_serving(client, path, body,
                                                                         where):
    c, _ = client
    limit = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    r = c.post(path, json={"model": "omni", limit: 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert where in error["message"] and "Traceback" not in r.text
    if path != "/v1/messages":
        assert error["param"] == where
    ok = c.post("/v1/chat/completions", json={"model": "omni", "max_tokens": 3,
                                              "messages": user(image_part(png()))})
    assert ok.status_code == 200, ok.text


def test_a_converted_omni_reads_media_as_its_source_does(omni, pair, tmp_path):
    from mlx_dspark.converter import convert
    out = convert(omni[0], tmp_path / "omni-mlx", progress=False)
    assert (out / "media.safetensors").is_file() and (out / "preprocessor_config.json").is_file()
    converted = md.load(str(out), "none", warm=False)
    messages = user(image_part(png(seed=7)), audio_part(wav(0.6)), {"type": "text", "text": "?"})
    ids = prompt_ids(converted.tokenizer, messages, True)
    assert text_ids(converted.target, ids) == text_ids(
        pair.target, prompt_ids(pair.tokenizer, messages, True))
    a, b = converted.target, pair.target
    assert mx.array_equal(a.step(step_input(a, ids), a.make_cache())[0],
                          b.step(step_input(b, prompt_ids(pair.tokenizer, messages, True)),
                                 b.make_cache())[0]).item()


def test_media_the_memory_cannot_hold_are_refused_before_the_towers_load(omni, monkeypatch):
    from mlx_dspark.checkpoint import memory
    pair = md.load(str(omni[0]), "none", verify="none", warm=False)
    monkeypatch.setattr(memory, "available_memory", lambda: (1000, "the test's budget"))
    with pytest.raises(memory.InsufficientMemory, match="its vision and audio towers need"):
        prompt_ids(pair.tokenizer, user(image_part(png())), True)
    assert pair.tokenizer.media._model is None


def test_the_parts_keep_their_order_through_the_chat_template(pair):
    ids = prompt_ids(pair.tokenizer, user({"type": "text", "text": "ab"}, audio_part(wav(0.3)),
                                          {"type": "text", "text": "cd"}, image_part(png())),
                     True)
    text = pair.tokenizer.decode(text_ids(pair.target, ids))
    n_audio = text.count("<so_embedding>")
    n_image = text.count("<image>")
    assert text == (f"<|user|>ab<so_start>{'<so_embedding>' * n_audio}<so_end>"
                    f"cd<img>{'<image>' * n_image}</img>\n<|assistant|>")
    assert n_audio > 0 and n_image > 0
