"""Which grammar engine: per-token mask cost and rollback, measured on the same grammar.

Speculative decoding needs of a grammar engine (docs/design.md §7, issue 22): a mask per
position (the drafter's N drafts and the verify pass's N+1 rows) and a rollback of the drafts
the target rejected. This walks one JSON-schema document token by token through each engine
that is installed (llguidance, xgrammar, outlines-core) and reports, per vocabulary:

* setup: preparing the vocabulary (once per tokenizer);
* compile: building the grammar for the vocabulary (once per schema);
* mask: computing the next-token bitmask, per token (median, p90, max), the cost on the
  critical path of every constrained step;
* consume: advancing the matcher by one token;
* rollback: consuming 7 drafts and rolling them back, then checking the mask equals the one
  computed before (what a rejected draft needs);
* dependencies: what ``pip install`` brings (a runtime dependency must stay light);
* and for llguidance, the loop's own mask (grammar.Constraint.mask: the stop-token overlay and
  the bitmask unpacked by MLX included).

Then, on the demo pair through the loop (``--demo``; greedy, num_draft 3, speculative "on" and
"off" in the same run): tokens per round with and without a grammar, the time of one mask
(grammar.Constraint.bits: llguidance plus the stop-token overlay) against a serial decode
step and a speculative round, and how much of the mask time the loop hides behind the GPU's
work (in a serial step the mask is computed while the target computes its logits).

Two vocabularies: 131072 tokens (Nemotron's size; a byte-level BPE trained here on the Python
standard library, cached in ``~/.cache/mlx-dspark``, ~20 s the first time) and the demo pair's
4096-token sentencepiece vocabulary.

    python benchmarks/bench_grammar.py [--engines llguidance] [--demo | --only-demo] [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as metadata
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

DEMO = Path(__file__).resolve().parents[1] / "mlx_dspark" / "demo" / "target" / "tokenizer.json"
CACHE = Path.home() / ".cache" / "mlx-dspark" / "bench_grammar_bpe131072.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string"}}, "required": ["street", "city", "zip"]},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "score", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@analytical.engine",
    "tags": ["mathematics", "poetry", "computing", "notes on the engine"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "role": "admin", "score": 97.25, "active": True,
}


def bpe131072() -> str:
    """tokenizer.json of a 131072-token byte-level BPE (trained once, then cached)."""
    if CACHE.exists():
        return CACHE.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                             recursive=True))

    def texts(limit=60e6):
        n = 0
        for f in files:
            try:
                text = Path(f).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            n += len(text)
            yield text
            if n > limit:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=131072, special_tokens=["<unk>", "<s>", "</s>"], min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(tok.to_str())
    return CACHE.read_text()


def token_bytes(tokenizer_json: str) -> tuple[list[bytes], int]:
    """Each id's bytes (byte-level BPE or sentencepiece with byte fallback) and the eos id."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tokenizer_json)
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1
    byte_level = "ByteLevel" in tokenizer_json[:20000] or \
        json.loads(tokenizer_json)["decoder"]["type"] == "ByteLevel"
    if byte_level:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        unbyte = {c: b for b, c in bytes_to_unicode().items()}
    out = [b""] * n
    for s, i in vocab.items():
        if byte_level:
            out[i] = bytes(unbyte.get(c, 0) for c in s)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out[i] = bytes([int(s[3:5], 16)])
        else:
            out[i] = s.replace("\u2581", " ").encode()
    return out, tok.token_to_id("</s>")


# ---------------------------------------------------------------------------------------------
# One adapter per engine: compile(), then mask() / consume(t) / rollback(n) on one matcher.


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json, vocab, eos):
        import llguidance
        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.vocab = vocab
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        self.m = self.ll.LLMatcher(self.tok, grammar)
        assert not self.m.is_error(), self.m.get_error()

    def mask(self):
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return self.bits.copy()

    def consume(self, t):
        assert self.m.consume_token(t), self.m.get_error()

    def rollback(self, n):
        assert self.m.rollback(n)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json, vocab, eos):
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xg = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=_from_str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                       stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bits = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        self.m = self.xg.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self):
        self.m.fill_next_token_bitmask(self.bits)
        return self.bits.numpy()[0].copy()

    def consume(self, t):
        assert self.m.accept_token(t)

    def rollback(self, n):
        self.m.rollback(n)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json, vocab, eos):
        import outlines_core
        self.oc = outlines_core
        pieces, _ = token_bytes(tokenizer_json)
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(pieces):
            if b and i != eos:
                table.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, table)
        self.bits = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        self.m = self.oc.Guide(self.oc.Index(regex, self.vocabulary), max_rollback=16)

    def mask(self):
        self.m.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)
        return self.bits[0].copy()

    def consume(self, t):
        self.m.advance(t)

    def rollback(self, n):
        self.m.rollback_state(n)


def _from_str(tokenizer_json):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(tokenizer_json)


ENGINES = {"llguidance": (Llguidance, "llguidance"), "xgrammar": (Xgrammar, "xgrammar"),
           "outlines-core": (OutlinesCore, "outlines_core")}


def requirements(dist: str) -> str:
    reqs = metadata.requires(dist) or []
    names = sorted({r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].split("[")[0]
                    .strip() for r in reqs if "extra ==" not in r})
    return ", ".join(names) or "none"


def measure(engine_cls, tokenizer_json, vocab, eos, ids):
    t0 = time.perf_counter()
    e = engine_cls(tokenizer_json, vocab, eos)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    e.compile(SCHEMA)
    t_compile = time.perf_counter() - t0
    masks, t_mask, t_consume = [], [], []
    for t in ids:
        t0 = time.perf_counter()
        m = e.mask()
        t1 = time.perf_counter()
        assert m[t // 32] >> (t % 32) & 1, f"{e.name}: token {t} of the document masked out"
        e.consume(t)
        t_consume.append(time.perf_counter() - t1)
        t_mask.append(t1 - t0)
        masks.append(m)
    # Rollback: drafts consumed then rejected leave the matcher where it was.
    k = min(7, len(ids) - 1)
    e.m.reset()
    for t in ids[:-k]:
        e.consume(t)
    before = e.mask()
    for t in ids[-k:]:
        e.consume(t)
    t0 = time.perf_counter()
    e.rollback(k)
    t_rb = time.perf_counter() - t0
    rollback_ok = np.array_equal(e.mask(), before)
    ms = np.array(t_mask) * 1e3
    return dict(engine=e.name, setup_ms=t_setup * 1e3, compile_ms=t_compile * 1e3, mask_median_ms=float(np.median(ms)),
                mask_p90_ms=float(np.percentile(ms, 90)), mask_max_ms=float(ms.max()),
                consume_us=statistics.median(t_consume) * 1e6, rollback_us=t_rb * 1e6,
                rollback_exact=bool(rollback_ok))


def loop_mask_cost(tokenizer_json: str, vocab: int, eos: int) -> float:
    """Median ms of the loop's own mask (grammar.Constraint.mask: llguidance, the stop-token
    overlay, the bitmask unpacked to booleans by MLX, evaluated) along the document."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    from mlx_dspark.grammar import grammars as grammar

    class Wrapped:      # what grammar.vocabulary reads of a tokenizer
        def __init__(self):
            self.backend_tokenizer = Tokenizer.from_str(tokenizer_json)
            self.eos_token_ids = [eos]

    g = grammar.json_schema(SCHEMA).bind(Wrapped(), vocab)   # compact JSON: retokenize
    ids = Tokenizer.from_str(tokenizer_json).encode(json.dumps(DOCUMENT, separators=(",", ":")),
                                                     add_special_tokens=False).ids
    c = grammar.Constraint(g, {eos}, vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        mx.eval(c.mask())
        times.append(time.perf_counter() - t0)
        c.advance(t)
    return 1e3 * statistics.median(times)


# ---------------------------------------------------------------------------------------------
# The demo pair through the loop

LOOP_SCHEMA = {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "tags"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer"},
                              "tags": {"type": "array", "maxItems": 4,
                                       "items": {"type": "string", "maxLength": 12}}}}
LOOP_TOOLS = [{"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "required": ["query", "limit"],
                                     "properties": {"query": {"type": "string", "maxLength": 40},
                                                    "limit": {"type": "integer"}}}}}]
LOOP_PROMPTS = ["def f(x):", "import json\n", "class Stack:\n", "for i in range(", "# parse the"]


def demo_loop(repeats: int = 3):
    import mlx_dspark as md
    from mlx_dspark.grammar import grammars as grammar

    pair = md.load()
    masks = []
    bits = grammar.Constraint.bits

    def timed_bits(self):
        t0 = time.perf_counter()
        out = bits(self)
        masks.append(time.perf_counter() - t0)
        return out

    grammar.Constraint.bits = timed_bits
    configs = [("none", {}),
               ("json_schema", {"response_format": {"type": "json_schema",
                                                    "json_schema": {"schema": LOOP_SCHEMA}}}),
               ("json_object", {"response_format": {"type": "json_object"}}),
               ("tool calls", {"grammar": grammar.tool_calls(LOOP_TOOLS)})]
    for p in LOOP_PROMPTS[:2]:                      # warm-up (compiles, caches)
        md.generate(pair, p, 16, speculative="on")
        md.generate(pair, p, 16, speculative="off")
    runs = {label: dict(on=[], off=[], masks=[], draft=[], verify=[], round=[])
            for label, _ in configs}
    for _ in range(repeats):        # interleaved: the machine's drift touches every config
        for label, kw in configs:
            r = runs[label]
            for p in LOOP_PROMPTS:
                masks.clear()
                s = md.generate(pair, p, 64, speculative="on", num_draft=3, **kw).stats
                r["masks"] += [(sum(masks), len(masks), s.generated)]
                r["on"].append(s)
                for key, t in (("draft", s.t_draft), ("verify", s.t_verify),
                               ("round", s.t_round)):
                    r[key].append(1e3 * t / max(s.rounds, 1))
                r["off"].append(md.generate(pair, p, 64, speculative="off", **kw).stats)
    rows = []
    print(f"\ndemo pair, greedy, num_draft 3, {len(LOOP_PROMPTS)} prompts x {repeats}, "
          f"64 tokens max; per round: medians over generations")
    print(f"  {'grammar':12} {'tokens/round':>12} {'accept/draft':>12} {'draft ms':>8} "
          f"{'verify ms':>9} {'round ms':>8} {'serial step ms':>14} {'mask ms':>7} "
          f"{'masks/token':>11}")
    for label, _ in configs:
        r = runs[label]
        on, off = r["on"], r["off"]
        t_mask, n_masks, generated = (sum(x) for x in zip(*r["masks"]))
        row = dict(grammar=label,
                   tokens_per_round=sum(s.generated - 1 for s in on)
                   / max(sum(s.rounds for s in on), 1),
                   acceptance=sum(s.accepted for s in on) / max(sum(s.drafted for s in on), 1),
                   draft_ms=statistics.median(r["draft"]),
                   verify_ms=statistics.median(r["verify"]),
                   round_ms=statistics.median(r["round"]),
                   serial_step_ms=statistics.median(1e3 * s.t_serial / max(s.serial_steps, 1)
                                                    for s in off),
                   mask_ms=1e3 * t_mask / n_masks if n_masks else 0.0,
                   masks_per_token=n_masks / generated)
        rows.append(row)
        print(f"  {label:12} {row['tokens_per_round']:12.2f} {row['acceptance']:12.2f} "
              f"{row['draft_ms']:8.2f} {row['verify_ms']:9.2f} {row['round_ms']:8.2f} "
              f"{row['serial_step_ms']:14.2f} {row['mask_ms']:7.3f} "
              f"{row['masks_per_token']:11.2f}")
    grammar.Constraint.bits = bits
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--demo", action="store_true",
                    help="also measure the demo pair through the loop (tokens per round, "
                         "mask time vs decode step)")
    ap.add_argument("--only-demo", action="store_true", help="the demo measurement only")
    args = ap.parse_args(argv)
    if args.only_demo:
        demo_loop()
        return 0
    vocabularies = [("131072 (byte-level BPE)", bpe131072()), ("demo 4096 (sentencepiece)",
                                                                DEMO.read_text())]
    text = json.dumps(DOCUMENT)
    rows = []
    for label, tj in vocabularies:
        tok = _from_str(tj)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos = tok.token_to_id("</s>")
        ids = tok.encode(text, add_special_tokens=False).ids
        print(f"\nvocabulary {label}: {vocab} tokens; document {len(text)} chars = "
              f"{len(ids)} tokens")
        print(f"  {'engine':14} {'setup ms':>8} {'compile ms':>10} {'mask ms med':>11} {'p90':>6} {'max':>6} "
              f"{'consume us':>10} {'rollback(7) us':>14} exact  requires")
        for name in args.engines.split(","):
            cls, module = ENGINES[name]
            try:
                __import__(module)
            except ImportError:
                print(f"  {name:14} not installed")
                continue
            r = measure(cls, tj, vocab, eos, ids)
            r.update(vocabulary=label, requires=requirements(name))
            rows.append(r)
            print(f"  {name:14} {r['setup_ms']:8.0f} {r['compile_ms']:10.1f} {r['mask_median_ms']:11.3f} "
                  f"{r['mask_p90_ms']:6.3f} {r['mask_max_ms']:6.3f} {r['consume_us']:10.1f} "
                  f"{r['rollback_us']:14.1f} {str(r['rollback_exact']):5}  {r['requires']}")
        if "llguidance" in args.engines:
            ms = loop_mask_cost(tj, vocab, eos)
            rows.append(dict(vocabulary=label, loop_mask_ms=ms))
            print(f"  the loop's mask (grammar.Constraint.mask, evaluated): {ms:.3f} ms median")
    if args.demo:
        rows += demo_loop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
