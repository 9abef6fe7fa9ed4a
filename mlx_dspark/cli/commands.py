"""The runtime subcommands of ``mlx-dspark``: ``generate``, ``chat``, ``bench`` and ``serve``
(ARCHITECTURE.md).

This module only defines arguments and handlers; MLX, the models and the tokenizer are
imported inside the handlers, so ``mlx-dspark convert`` and ``--help`` stay quick. Problems a
user can fix (a missing directory, a drafter for another target, a corrupt checkpoint, a
prompt that does not fit) raise :class:`CommandError`, which the CLI prints as one line."""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path

from ..decode.pieces import PREFILL_BUDGET
from ..stats import format_stats

from ..request import AUTO_DRAFT, MODES, RequestError, check_sampling
from .common import (CatchInterrupt, CommandError, PrefillMeter, _at_least, _positive,
                     add_model_arguments, add_num_draft_argument, add_sampling_arguments,
                     add_scheme_argument, add_stats_argument, add_system_prompt_argument,
                     add_template_arguments, flag_error, load_pair, request_options,
                     require_chat_template, utf8_text)
from .interrupted import finished


# ---------------------------------------------------------------------------------------------
# generate


GENERATE_HELP = "generate a completion of one prompt, streamed to standard output"


def generate_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", metavar="TEXT",
                   help="the prompt; without it (or with '-') it is read from standard input")
    add_system_prompt_argument(p)
    template = p.add_mutually_exclusive_group()
    template.add_argument("--ignore-chat-template", action="store_true",
                          help="complete the prompt as given; by default it goes through the "
                               "model's chat template when the tokenizer has one (as mlx-lm)")
    template.add_argument("--chat", action="store_true",
                          help="require the chat template (an error when the model has none)")
    media = p.add_argument_group("media", "for a Nemotron Omni model, with the omni extra "
                                 "(pip install 'mlx-dspark[omni]'): each file goes before the "
                                 "prompt's text in the user message, images first")
    media.add_argument("--image", action="append", default=[], metavar="PATH",
                       help="an image (PNG, JPEG, WebP, GIF, BMP); repeatable")
    media.add_argument("--audio", action="append", default=[], metavar="PATH",
                       help="an audio clip (WAV, MP3, FLAC, Ogg Vorbis); repeatable")
    add_sampling_arguments(p, max_tokens=256)
    add_stats_argument(p)


def media_content(args: argparse.Namespace, text: str) -> tuple[list, dict]:
    """The user message's content parts for --image and --audio, then the text; and which flag
    each part's path in the request came from."""
    from ..media.parts import AUDIO_FORMATS
    content, flags = [], {}
    for flag, paths in (("--image", args.image), ("--audio", args.audio)):
        for path in paths:
            try:
                data = base64.b64encode(Path(path).read_bytes()).decode()
            except OSError as e:
                raise CommandError(f"{flag} {path}: cannot read it ({e.strerror or e})") \
                    from None
            fmt = Path(path).suffix.lower().lstrip(".")
            if flag == "--audio" and fmt not in AUDIO_FORMATS:
                raise CommandError(f"{flag} {path}: an audio file is one of "
                                   f"{', '.join('.' + f for f in AUDIO_FORMATS)}")
            flags[f"messages[-1].content[{len(content)}]"] = f"{flag} {path}"
            content.append({"type": "image_url", "image_url": {
                "url": f"data:image;base64,{data}"}} if flag == "--image" else
                {"type": "input_audio", "input_audio": {"data": data, "format": fmt}})
    return content + [{"type": "text", "text": text}], flags


def run_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            raise CommandError("no prompt: pass --prompt TEXT or pipe the prompt on stdin")
        data = sys.stdin.buffer.read()
        prompt = utf8_text(data.decode("utf-8", "surrogateescape"), "the prompt on standard input")
    else:
        prompt = utf8_text(prompt, "--prompt")
    if not prompt:
        raise CommandError("empty prompt")
    if args.system_prompt is not None:
        utf8_text(args.system_prompt, "--system-prompt")
    for flag, value in (("--reasoning", args.reasoning), ("--system-prompt", args.system_prompt)):
        if value and args.ignore_chat_template:
            raise CommandError(f"{flag} applies to the chat template: drop --ignore-chat-template")
    pair = load_pair(args)
    from .. import api
    from ..text.tokenizer import template_options

    templated = getattr(pair.tokenizer, "has_chat_template", False) \
        and not args.ignore_chat_template
    media = args.image or args.audio
    if args.chat or media or (not templated and (args.reasoning or args.system_prompt)):
        require_chat_template(pair, args)
    flags = {}
    if templated:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        if media:
            content, flags = media_content(args, prompt)
            flags = {k.replace("[-1]", f"[{len(system)}]"): v for k, v in flags.items()}
            prompt = system + [{"role": "user", "content": content}]
        else:
            prompt = system + [{"role": "user", "content": prompt}]
    # Ctrl-C stops at the next token or prefill piece (a second one at once), so the stats
    # stay whole; a long prompt's prefill shows its progress.
    interrupt = CatchInterrupt(once=True)
    try:      # the prompt does not fit the model, --num-draft beyond the drafter, ...
        request = api.make_request(pair, prompt, chat=templated,
                                   chat_template_kwargs=template_options(
                                       pair.tokenizer, args.reasoning, args.chat_template_args),
                                   **request_options(args))
        stream = api.stream(pair, request, progress=PrefillMeter(interrupt))
    except ValueError as e:
        where = getattr(e, "param", None)
        if where in flags:            # a media part: named by its flag and file
            raise CommandError(flags[where] + str(e)[len(where):]) from None
        raise flag_error(e) from None
    stats = None
    with interrupt:
        try:
            for chunk in stream:
                sys.stdout.write(chunk.reasoning + chunk.text)   # thinking, then the answer
                sys.stdout.flush()
                stats = chunk.stats
                if interrupt.hit:
                    break
        except KeyboardInterrupt:  # Ctrl-C in the prefill (at its next piece), or a second one
            interrupt.hit = True
        finally:
            stream.close()
    if interrupt.hit and stats is not None:
        stats.finish_reason = "interrupted"
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupt.hit:
        finished()      # a Ctrl-C from here on would say "interrupted" a second time
        print("mlx-dspark generate: interrupted", file=sys.stderr)
    if args.stats and stats is not None:
        print("\n".join(["=========="] + format_stats(stats)), file=sys.stderr)
    return 130 if interrupt.hit else 0


# ---------------------------------------------------------------------------------------------
# chat


CHAT_HELP = "chat with the model in the terminal (/help inside lists the commands)"


def chat_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p, max_tokens=512)
    add_system_prompt_argument(p)
    p.add_argument("--hide-thinking", action="store_true",
                   help="do not show the model's thinking, only its answers")
    add_prompt_cache_arguments(p)
    p.add_argument("--resume", metavar="NAME",
                   help="continue the conversation saved with /save NAME (or cache-prompt -o "
                        "NAME) without prefilling it again")


def run_chat(args: argparse.Namespace) -> int:
    if args.system_prompt is not None:
        utf8_text(args.system_prompt, "--system-prompt")
    pair = load_pair(args)
    from .chat import Chat

    require_chat_template(pair, args)
    with_prompt_cache(pair, args)
    return Chat(pair, args).run()


def with_prompt_cache(pair, args: argparse.Namespace):
    """Give the pair the prompt cache of --prompt-cache-dir (in memory and on disk)."""
    if args.prompt_cache_dir is not None:
        from ..prompt_cache.cache import PromptCache
        pair.prompt_cache = PromptCache(1 << 30, disk_store_factory(args)(pair, pair))


# ---------------------------------------------------------------------------------------------
# cache-prompt


CACHE_PROMPT_HELP = "prefill a long shared prefix (a system prompt, a document) once, to disk"


def cache_prompt_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", required=True, metavar="FILE|TEXT",
                   help="the prefix: a file's text, or the text itself; with a chat template "
                        "it becomes the system message")
    p.add_argument("-o", "--output", required=True, metavar="NAME",
                   help="save it as NAME (chat --resume NAME continues from it)")
    add_prompt_cache_arguments(p)


def run_cache_prompt(args: argparse.Namespace) -> int:
    import time

    text = args.prompt
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CommandError(f"{args.prompt}: cannot read it as UTF-8 text ({e})") from None
    utf8_text(text, "--prompt")
    if not text:
        raise CommandError("--prompt: empty text")
    pair = load_pair(args)
    from ..decode.loop import prefill
    from ..decode.session import Session
    from ..prompt_cache.disk import SnapshotError, open_store
    from ..text.tokenizer import _encode
    from .chat import default_prompt_dir

    tok = pair.tokenizer
    if getattr(tok, "has_chat_template", False):
        messages = [{"role": "system", "content": text}]
        ids = _encode(tok, tok.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=False))
    else:
        messages, ids = [], list(tok.encode(text))
    try:
        store = open_store(args.prompt_cache_dir or default_prompt_dir(), pair,
                           pair.drafter is not None, int(args.prompt_cache_disk_gb * 1e9))
        path = store.named_path(args.output)
    except (SnapshotError, OSError) as e:
        raise CommandError(f"prompt cache: {e}") from None
    session = Session(pair.target, pair.drafter, home=pair)    # one piece, as a cold serve's
    t0 = time.perf_counter()
    prefill(session, ids, tap=pair.drafter is not None, progress=PrefillMeter())
    snap = session.snapshot()
    t1 = time.perf_counter()
    try:
        store.save_named(args.output, snap, {"messages": messages, "ids": ids})
        store.add(snap)         # also an ordinary snapshot: serve and chat find it by its tokens
    except OSError as e:
        raise CommandError(f"{path}: cannot write ({e.strerror or e})") from None
    print(f"saved {len(ids)} tokens ({snap.nbytes / 1e6:.1f} MB of state, prefilled in "
          f"{t1 - t0:.2f} s, written in {time.perf_counter() - t1:.2f} s) as {args.output!r} "
          f"in {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# bench


BENCH_HELP = "serial vs speculative decoding on built-in code, math and chat prompts"


def bench_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, many_drafters=True)
    p.add_argument("-m", "--max-tokens", type=_at_least(4), default=64, metavar="N",
                   help="tokens generated per prompt and mode, at least 4 so that both modes "
                        "have steps to time (default 64)")
    add_num_draft_argument(p, sweep=True)
    p.add_argument("--drafters", metavar="all|A,B",
                   help="the drafters to compare (instead of --drafter): all: every kind "
                        "this runtime registers that the pair can run, or a comma-separated "
                        "list of names or directories")
    p.add_argument("--temp", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling")
    add_scheme_argument(p, default="rejection")
    p.add_argument("--repeats", type=_positive, default=3, metavar="R",
                   help="runs per prompt and mode; the median and the min-max over them are "
                        "reported, and a spread wider than a difference is called noise "
                        "(default 3)")
    p.add_argument("--domains", metavar="LIST",
                   help="comma-separated subset of the prompt domains (code,math,chat)")
    p.add_argument("--limit", type=_positive, metavar="N", help="at most N prompts per domain")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on standard output (fields: README)")
    p.add_argument("--plot", metavar="PNG",
                   help="also draw acceptance by position and speedup per domain (matplotlib)")
    p.set_defaults(speculative="auto")      # bench runs every mode


def run_bench(args: argparse.Namespace) -> int:
    from . import bench
    return bench.run(args)


# ---------------------------------------------------------------------------------------------
# serve


# serve's --max-batch: where the aggregate throughput of concurrent requests on the demo pair
# measured highest (benchmarks/bench_max_batch.py, docs/serve.md "Many requests at once")
MAX_BATCH = 4

SERVE_HELP = ("an OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, "
              "/v1/completions, /v1/responses, /v1/messages)")


def _tokens_per_step(s: str) -> float:
    """An argparse type: a number of tokens per step, above 0 (a fraction: a token every few
    steps)."""
    n = float(s)
    if not 0 < n < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {s}")
    return n


_tokens_per_step.__name__ = "number"


def serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_at_least(0, 65535), default=8080, help="port (default 8080)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another name /v1/models lists for the model (a client that checks "
                        "its model name there finds it; any name a request gives is answered "
                        "anyway); repeatable")
    p.add_argument("--max-batch", type=_at_least(1), default=MAX_BATCH, metavar="N",
                   help="requests decoded together, each exactly as alone (a thinking "
                        "budget's too); 1: one at a time "
                        f"(default {MAX_BATCH}: the highest aggregate throughput measured, "
                        "docs/serve.md)")
    p.add_argument("--prefill-budget", type=_tokens_per_step, default=PREFILL_BUDGET,
                   metavar="N",
                   help="prompt tokens a joining request prefills per step, on average, "
                        "while others decode (whole pieces, as the budget accrues): lower "
                        "keeps the decoding rows' pace, higher the prefill's "
                        f"(default {PREFILL_BUDGET:g}, docs/batching.md)")
    p.add_argument("--max-queue", type=_at_least(0), default=16, metavar="N",
                   help="requests that may wait while the batch is full; more get HTTP 503 "
                        "(default 16)")
    p.add_argument("--prefix-cache-mb", type=_at_least(0), default=1024, metavar="MB",
                   help="memory for state snapshots a request can continue from (a chat's "
                        "earlier turns); 0 turns prefix reuse off (default 1024)")
    add_prompt_cache_arguments(p)
    add_num_draft_argument(p)
    p.add_argument("--speculative", choices=MODES, default="auto",
                   help="auto: speculate only while it pays (default); on: always; off: never")
    defaults = p.add_argument_group(
        "request defaults", "for fields a request leaves out; without the flag, the model's "
        "generation_config.json, else OpenAI's (temperature 1, top_p 1, no top_k, no limit)")
    defaults.add_argument("--temp", type=float, metavar="T", help="temperature (0: greedy)")
    defaults.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling")
    defaults.add_argument("--top-k", type=int, metavar="K", help="0 keeps all tokens")
    defaults.add_argument("-m", "--max-tokens", type=_positive, metavar="N",
                          help="most tokens per answer")
    add_template_arguments(defaults)
    # Exposure and connections (docs/serve.md, "Exposure")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="a Nemotron Omni model's image_url parts may name files under DIR "
                        "(file:// URLs); without it only data URLs are read, and nothing is "
                        "ever fetched")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (https://app.example) call the server "
                        "(CORS); '*' for any; repeatable (default: no browser origin)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="accept requests whose Host is NAME too (default: localhost names and "
                        "the --host address); repeatable")
    p.add_argument("--max-request-mb", type=_at_least(1), default=8, metavar="MB",
                   help="largest request body; larger ones get HTTP 413 (default 8)")
    p.add_argument("--max-connections", type=_at_least(1), default=1000, metavar="N",
                   help="open connections; past it the one slowest to send its request is "
                        "closed (default 1000)")
    p.add_argument("--read-timeout", type=_at_least(1), default=30, metavar="S",
                   help="seconds a client has to send a whole request (default 30)")
    p.add_argument("--idle-timeout", type=_at_least(1), default=5, metavar="S",
                   help="seconds an idle kept-alive connection stays open (default 5)")


# serve's flag -> (the request field it defaults, generation_config.json's key)
SERVE_DEFAULTS = {"temp": ("temperature", "temperature"), "top_p": ("top_p", "top_p"),
                  "top_k": ("top_k", "top_k"), "max_tokens": ("max_tokens", "max_new_tokens")}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve_defaults(args: argparse.Namespace, model_dir) -> dict:
    """The defaults of request fields: the flags given, else the model's
    generation_config.json (``do_sample: false`` there means greedy), checked as a request's."""
    import json

    generation = {}
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            generation = json.loads(path.read_text())
        except ValueError as e:
            raise CommandError(f"{path}: not valid JSON ({e})") from None
        if generation.get("do_sample") is False:
            generation["temperature"] = 0.0
    out = {}
    for flag, (field, key) in SERVE_DEFAULTS.items():
        value = getattr(args, flag)
        if value is None:
            value = generation.get(key)
        if value is not None:
            out[field] = value
    try:
        check_sampling(out.get("temperature", 0.0), out.get("top_p", 1.0), out.get("top_k", 0))
    except RequestError as e:
        raise flag_error(e) from None
    if args.chat_template_args:
        out["chat_template_kwargs"] = args.chat_template_args
    return out


def model_names(args: argparse.Namespace, model_dir) -> list[str]:
    """The id the server reports first, then every other name a client may use for it: the
    name, path or repo id it was started with, and the directory it was loaded from."""
    from pathlib import Path

    if args.model is None:
        return ["mlx-dspark-demo"]
    names = [Path(args.model).name, args.model]
    if model_dir is not None:
        names += [str(model_dir), str(Path(model_dir).resolve())]
    return list(dict.fromkeys(names))


def add_prompt_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="also keep state snapshots on disk in DIR, across restarts "
                        "(docs/prompt-cache.md)")
    p.add_argument("--prompt-cache-disk-gb", type=_gigabytes, default=10, metavar="GB",
                   help="disk for the snapshots in --prompt-cache-dir, least recently used "
                        "out first (default 10)")


def _gigabytes(s: str) -> float:
    gb = float(s)
    if not 0 <= gb < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a size in GB, 0 or more, not {s}")
    return gb


_gigabytes.__name__ = "size"


def disk_store_factory(args: argparse.Namespace):
    """What Engine(store=...) calls once the pair is loaded: the store of --prompt-cache-dir,
    or None."""
    if args.prompt_cache_dir is None:
        return None

    def make(pair, session):
        from ..prompt_cache.disk import SnapshotError, open_store
        try:
            return open_store(args.prompt_cache_dir, pair, session.drafter is not None,
                              int(args.prompt_cache_disk_gb * 1e9))
        except (SnapshotError, OSError) as e:
            raise CommandError(f"--prompt-cache-dir {args.prompt_cache_dir}: {e}") from None
    return make


def run_serve(args: argparse.Namespace) -> int:
    from .. import api
    from ..serve.app import listen, serve
    from ..serve.connections import Limits
    from ..serve.engine import Engine
    from ..serve.http_guard import Exposure
    from ..text.chat_template import check_template_variables

    if args.api_key is not None and not args.api_key:
        print("mlx-dspark serve: error: --api-key is empty: no request could match it "
              "(give a key, or leave the flag out)", file=sys.stderr)
        return 2
    try:
        check_template_variables(args.chat_template_args)
    except ValueError as e:
        print(f"mlx-dspark serve: error: --chat-template-args: {e}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and args.api_key is None:
        print(f"mlx-dspark serve: warning: listening on {args.host} without --api-key: anyone "
              f"who can reach this machine can use the model", file=sys.stderr)
    try:
        api.check_sources(args.model)       # a wrong path is named before the port is tried
    except FileNotFoundError as e:
        print(f"mlx-dspark serve: error: {e}", file=sys.stderr)
        return 1
    try:
        sock = listen(args.host, args.port)     # before loading: a busy port costs nothing
    except OSError as e:
        print(f"mlx-dspark serve: error: cannot listen on {args.host}:{args.port}: "
              f"{e.strerror or e} (another server there? pick another --port)", file=sys.stderr)
        return 1
    exposure = Exposure(bound=args.host, hosts=frozenset(h.lower() for h in args.allow_host),
                        origins=frozenset(o.rstrip("/") for o in args.allow_origin),
                        max_body=args.max_request_mb << 20)
    limits = Limits(read_timeout=args.read_timeout, idle_timeout=args.idle_timeout,
                    max_connections=args.max_connections)
    engine = Engine(lambda: load_pair(args), args.max_queue, args.prefix_cache_mb << 20,
                    use_drafter=args.speculative != "off", store=disk_store_factory(args),
                    max_batch=args.max_batch, prefill_budget=args.prefill_budget)
    code = 0
    try:
        engine.start()      # loads the pair on the engine's thread; CommandError comes here
        _check_serve_flags(engine.pair, args)
        defaults = serve_defaults(args, engine.pair.path)
        names = model_names(args, engine.pair.path)
        print(banner(engine.pair, names[0], sock, defaults), file=sys.stderr, flush=True)
        serve(engine, names, sock, args.api_key,
              dict(defaults, num_draft=args.num_draft, speculative=args.speculative),
              exposure, limits, args.alias)
    except KeyboardInterrupt:
        print("mlx-dspark serve: interrupted", file=sys.stderr)
        code = 130
    except CommandError as e:
        print(f"mlx-dspark serve: error: {e}", file=sys.stderr)
        code = 1
    finally:
        engine.stop()
        sock.close()
    # Everything is stopped and flushed. The interpreter's own exit can still abort here
    # ("terminate called without an active exception": native threads torn down after a
    # server run), which would turn a clean Ctrl-C into SIGABRT, so leave without finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def banner(pair, model_id: str, sock, defaults: dict) -> str:
    """What is served, where, with what memory: the start line."""
    import mlx.core as mx

    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    drafter = pair.drafter_note or ("with its DSpark drafter" if pair.drafter is not None
                                    else "serial only (no drafter)")
    dtype = str(pair.target.dtype).rsplit(".", 1)[-1]
    shown = ", ".join(f"{k} {v}" for k, v in defaults.items()) or "OpenAI's"
    return (f"mlx-dspark serve: {model_id} ({pair.path}) {drafter}, {dtype}, "
            f"{mx.get_active_memory() / 1e9:.3f} GB in memory, on http://{host}:{port}/v1 "
            f"(request defaults: {shown})")


def _check_serve_flags(pair, args: argparse.Namespace):
    """What the server's every request would be refused for, refused once at start."""
    if args.speculative == "on" and pair.drafter is None:
        raise CommandError("--speculative on needs a drafter (--drafter DIR)")
    if pair.drafter is not None and args.num_draft != AUTO_DRAFT \
            and args.num_draft > pair.drafter.max_draft:
        raise CommandError(f"--num-draft {args.num_draft}: this drafter proposes at most "
                           f"{pair.drafter.max_draft} tokens per round")
