"""Grammar-constrained decoding: what the output must match, and the mask of each next token.

A :class:`Grammar` is a value (free of MLX): llguidance's grammar text and what it came from
(a JSON schema, any JSON object, Nemotron's tool calls, a Lark grammar). It rides on a
:class:`~mlx_dspark.request.Request`, bound to the tokenizer's vocabulary by
:meth:`Grammar.bind`. A :class:`Constraint` is one decode call's matcher over it: the boolean
mask of the next token (``mask``), ``advance`` over emitted tokens, ``rollback`` of rejected
drafts, and ``drafting``, the drafter's per-row hook (docs/design.md §7, "Grammars").

The engine is llguidance, chosen by measurement (benchmarks/bench_grammar.py): the cheapest
mask per token at a 131072-token vocabulary, exact rollback of consumed tokens, context-free
grammars (outlines-core is regular only, so no ``json_object`` or nested tool arguments) and
no dependencies (xgrammar requires torch). It is imported when a grammar is first used.

Stop tokens (the request's, eos among them) are allowed exactly when the grammar accepts: a
constrained answer ends only complete."""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from ..request import RequestError


def _ll():
    try:
        import llguidance
    except ImportError:
        raise RequestError("grammar", "grammars need the llguidance package "
                                      "(pip install llguidance)") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a generation must match: a Lark grammar in llguidance's dialect (``source``,
    whose ``start`` rule is the whole output) and a ``label`` saying what it came from. Make
    one with :func:`json_schema`, :func:`json_object`, :func:`tool_calls` or :func:`lark`;
    ``vocabulary`` is set by :meth:`bind`."""

    source: str
    label: str
    vocabulary: object = field(default=None, compare=False, repr=False)

    def bind(self, tokenizer, vocab_size: int) -> "Grammar":
        """This grammar over ``tokenizer``'s tokens (a model vocabulary of ``vocab_size``)."""
        return replace(self, vocabulary=vocabulary(tokenizer, vocab_size))

    def after_thinking(self) -> "Grammar":
        """Free text up to the first ``</think>``, up to 3 blank characters, then this
        grammar: for a prompt that opens a thinking block (the constraint applies to the
        answer, not to the reasoning; the blanks bound what a small model may pad)."""
        body = re.sub(r"^start(?=\s*:)", "answer", self.source, flags=re.M)
        return replace(self, source="start: think BLANK? answer\n"
                                    "think[lazy]: /(?s:.*)<\\/think>/\n"
                                    "BLANK: /[ \\t\\r\\n]{1,3}/\n" + body,
                       label=self.label + " after thinking")


def _checked(source: str, label: str, param: str) -> Grammar:
    error, messages = _ll().LLMatcher.validate_grammar_with_warnings(source)
    if error:
        raise RequestError(param, f"{label}: {messages[0].splitlines()[0]}")
    return Grammar(source, label)


# JSON without whitespace ({"a":1,"b":[2,3]}): a small model cannot pad an answer with blanks
# until max_tokens.
_COMPACT = {"whitespace_flexible": False}


def json_schema(schema: dict, param: str = "grammar") -> Grammar:
    """Output that is one JSON value valid against ``schema`` (a dict)."""
    if not isinstance(schema, dict):
        raise RequestError(param, f"a JSON schema is an object, not {type(schema).__name__}")
    return _checked(f"start: {_json(schema, param)}", "JSON schema", param)


def json_object(param: str = "grammar") -> Grammar:
    """Output that is one JSON object (OpenAI's ``json_object``)."""
    return _checked(f"start: {_json({'type': 'object'})}", "JSON object", param)


def _json(schema: dict, param: str = "grammar") -> str:
    """A Lark item matching JSON valid against ``schema``, written compactly."""
    try:
        return f"%json {json.dumps({**schema, 'x-guidance': _COMPACT})}"
    except (TypeError, ValueError) as e:
        raise RequestError(param, f"a JSON schema must be JSON: {e}") from None


def lark(text: str, param: str = "grammar") -> Grammar:
    """Output in the language of a Lark grammar (llguidance's dialect)."""
    return _checked(text, "Lark grammar", param)


def response_format(value) -> Grammar | None:
    """The grammar of an OpenAI ``response_format`` (None for ``{"type": "text"}``)."""
    p = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(p)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError(p, "json_schema needs {\"json_schema\": {\"name\": ..., "
                                  "\"schema\": {...}}}")
        return json_schema(spec["schema"], p)
    raise RequestError(p, f"response_format type must be 'text', 'json_object' or "
                          f"'json_schema', not {kind!r}")


def of(value) -> Grammar | None:
    """What ``grammar=`` takes: a Grammar, a JSON schema (dict), or None."""
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, dict):
        return json_schema(value)
    raise RequestError("grammar", f"grammar must be a mlx_dspark.decode.grammar.Grammar or a JSON "
                                  f"schema (dict), not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Nemotron's tool calls:
#   <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
# String values are raw text, as the chat template writes them and tools.typed reads them (no
# "<", at most maxLength characters, or one of an enum); others are JSON typed by the
# parameter's schema. Parameters come in the schema's order, the required ones always.

_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


def tool_calls(tools: list, name: str | None = None, parallel: bool = True,
               prefix: str = "", param: str = "tools") -> Grammar:
    """Output that is one or more (``parallel``) tool calls in Nemotron's format, to any of
    ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) or only to ``name``.
    ``prefix``: the start of the first call, already in the prompt (a forced call's opening,
    such as ``"<tool_call>\n"``); the output is the rest."""
    functions = [t.get("function", t) if isinstance(t, dict) else None for t in tools or []]
    if not functions or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                for f in functions):
        raise RequestError(param, "tools must be a non-empty list of "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise RequestError("tool_choice", f"tool_choice names {name!r}, which is not "
                                              f"among the tools")
    rules, firsts = [], []
    for i, f in enumerate(functions):
        if not _NAME.match(f["name"]):
            raise RequestError(param, f"function name {f['name']!r}: use letters, digits, "
                                      f"_ . : -")
        opening = f"<tool_call>\n<function={f['name']}>\n"
        rules += [f"f{i}: {json.dumps(opening)} b{i}", *_body_rules(i, f, param)]
        if opening.startswith(prefix):       # the first call's rest after the prefix
            rest = opening[len(prefix):]
            firsts.append(f"{json.dumps(rest)} b{i}" if rest else f"b{i}")
    if not firsts:
        raise RequestError(param, f"no tool call starts with {prefix!r}")
    more = ' ("\\n" call)*' if parallel else ""
    text = (f"start: first{more}\nfirst: {' | '.join(firsts)}\n"
            f"call: {' | '.join(f'f{i}' for i in range(len(functions)))}\n" + "\n".join(rules))
    label = f"tool calls to {', '.join(f['name'] for f in functions)}"
    return _checked(text, label, param)


def _body_rules(i: int, f: dict, param: str) -> list[str]:
    """Rule ``b{i}``: a call's parameters and its closing tags."""
    schema = f.get("parameters") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts, rules = [], []
    for j, (key, spec) in enumerate(props.items()):
        if not _NAME.match(key):
            raise RequestError(param, f"{f['name']}: parameter name {key!r}: use letters, "
                                      f"digits, _ . : -")
        rule = f"f{i}p{j}"
        head = json.dumps(f"<parameter={key}>\n")
        close = json.dumps("\n</parameter>\n")
        choices = _text_choices(spec)
        if choices:
            rules.append(f"{rule}: {head} ({' | '.join(map(json.dumps, choices))}) {close}")
        elif _is_text(spec):
            rules.append(f"{rule}: {head} F{i}P{j}")
            most = spec.get("maxLength")
            count = f"{{0,{most}}}" if isinstance(most, int) and most >= 0 else "*"
            rules.append(f"F{i}P{j}: /[^<]{count}\\n<\\/parameter>\\n/")
        else:
            rules.append(f"{rule}: {head} {_json(spec, param)} {close}")
        parts.append(rule if key in required else f"{rule}?")
    rules.insert(0, f"b{i}: {' '.join(parts)} \"</function>\\n</tool_call>\"")
    return rules


def _is_text(spec) -> bool:
    """A parameter written as raw text (tools.typed reads it back as written): a string."""
    return isinstance(spec, dict) and spec.get("type") == "string"


def _text_choices(spec) -> list[str]:
    """The raw texts a string parameter with an ``enum`` or ``const`` may take."""
    if not _is_text(spec):
        return []
    values = spec["enum"] if isinstance(spec.get("enum"), list) else \
        [spec["const"]] if "const" in spec else []
    return [v for v in values if isinstance(v, str) and "<" not in v]


# ---------------------------------------------------------------------------------------------
# The vocabulary and the matcher

_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def vocabulary(tokenizer, vocab_size: int):
    """llguidance's view of a tokenizer (built once per tokenizer: ~0.7 s at 131072 tokens)."""
    if tokenizer is None:
        raise RequestError("grammar", "grammars need a tokenizer; this pair has none")
    key = getattr(tokenizer, "_tokenizer", tokenizer)
    held = _VOCABULARIES.get(key)
    if held is None or held.vocab_size != vocab_size:
        ll = _ll()
        backend = getattr(key, "backend_tokenizer", None)
        if backend is None:
            raise RequestError("grammar", "grammars need a fast (tokenizer.json) tokenizer")
        held = ll.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                              eos_token=list(getattr(tokenizer, "eos_token_ids", None)
                                             or [key.eos_token_id]))
        _VOCABULARIES[key] = held
    return held


class Constraint:
    """One decode call's matcher: the tokens emitted so far and, inside a round, the drafts.

    ``mask()`` is the boolean mask ``[V]`` (an mx.array) of the next token; the loop turns it
    into ``-inf`` on the logits (sampling.constrain) of the target and the drafter alike."""

    def __init__(self, grammar: Grammar, stop_tokens, vocab_size: int):
        if grammar.vocabulary is None:
            raise RequestError("grammar", "the grammar is not bound to a tokenizer "
                                          "(make the request with api.make_request)")
        self.stops = sorted(t for t in stop_tokens if t < vocab_size)
        if not self.stops:
            raise RequestError("grammar", "a constrained generation ends on a stop token, and "
                                          "this request has none")
        self.matcher = _ll().LLMatcher(grammar.vocabulary, grammar.source, log_level=0)
        self.vocab_size = vocab_size
        self.words = np.zeros((grammar.vocabulary.vocab_size + 31) // 32, dtype=np.int32)
        self.drafted = 0         # drafts consumed in this round (rolled back if rejected)
        self.halted = False      # a stop token was drafted: later drafts are never emitted
        self.masks = []          # this round's masks, row j after the first j drafts
        self._check()

    def _check(self):
        if self.matcher.is_error():
            raise RuntimeError(f"grammar: {self.matcher.get_error().splitlines()[0]}")

    def bits(self) -> np.ndarray:
        """The next token's allowed set as llguidance's bitmask words, stops set by whether
        the grammar accepts."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        self._check()
        words = self.words.view(np.uint32)
        done = self.matcher.is_accepting()
        for t in self.stops:
            if done:
                words[t >> 5] |= np.uint32(1 << (t & 31))
            else:
                words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return self.words.copy()

    def mask(self):
        """``[V]`` booleans (lazy mx.array) of the tokens allowed next."""
        import mlx.core as mx
        words = mx.array(self.bits().view(np.uint32))
        allowed = (words[:, None] >> mx.arange(32, dtype=mx.uint32)) & 1
        return allowed.reshape(-1)[:self.vocab_size].astype(mx.bool_)

    def advance(self, token: int):
        """Consume an emitted token (never a stop token: it ends the run unfed)."""
        if not self.matcher.consume_token(token):
            self._check()

    # The speculative round: drafts are consumed while they are drafted, the rejected ones
    # rolled back after verification.

    def drafting(self, j: int, prev):
        """The mask of draft ``j`` (0-based) given the draft before it (``prev``, lazy; the
        bonus, already emitted, when j == 0): the drafter's per-row hook."""
        if j == 0:
            self.drafted, self.halted, self.masks = 0, False, []
        else:
            token = prev.item()
            if token in self.stops:
                self.halted = True        # rows after a stop are cut before they are emitted
            elif not self.halted:
                self.advance(token)
                self.drafted += 1
        self.masks.append(self.mask())
        return self.masks[-1]

    def verify_masks(self, drafts):
        """The verify pass's masks ``[n+1, V]``: the drafter's n rows and the one after the
        last draft (``drafts``, lazy ``[n]``)."""
        import mlx.core as mx
        n = drafts.shape[0]
        self.drafting(n, drafts[n - 1:n])
        return mx.stack(self.masks)

    def settle(self, kept_drafts: int):
        """After verification: keep the first ``kept_drafts`` drafts, roll back the rest."""
        back = self.drafted - min(kept_drafts, self.drafted)
        if back and not self.matcher.rollback(back):
            self._check()
        self.drafted = 0
