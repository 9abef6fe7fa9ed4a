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
from . import limits


def _ll():
    try:
        import llguidance
    except ImportError:
        raise RequestError("grammar", "grammars need the llguidance package "
                                      "(pip install llguidance)") from None
    return llguidance


class GrammarError(RequestError):
    """A grammar llguidance refuses, or one that reaches one of its limits while decoding:
    its whole message, naming the parameter the grammar came from."""


@dataclass(frozen=True)
class Grammar:
    """What a generation must match: a Lark grammar in llguidance's dialect (``source``,
    whose ``start`` rule is the whole output), a ``label`` saying what it came from and the
    ``param`` it came in. Make one with :func:`json_schema`, :func:`json_object`,
    :func:`tool_calls` or :func:`lark`; ``vocabulary`` and ``compiled`` (the matcher every
    :class:`Constraint` copies) are set by :meth:`bind`."""

    source: str
    label: str
    param: str = "grammar"
    vocabulary: object = field(default=None, compare=False, repr=False)
    compiled: object = field(default=None, compare=False, repr=False)

    def bind(self, tokenizer, vocab_size: int) -> "Grammar":
        """This grammar over ``tokenizer``'s tokens (a model vocabulary of ``vocab_size``),
        compiled (grammar_limits.compiled) and its first mask computed, so that what
        llguidance refuses is refused here, before any decoding."""
        vocab = vocabulary(tokenizer, vocab_size)
        matcher = self._compile(_matcher, self.source, vocab)
        return replace(self, vocabulary=vocab, compiled=matcher)

    def after_thinking(self) -> "Grammar":
        """Free text up to the first ``</think>``, up to 3 blank characters, then this
        grammar: for a prompt that opens a thinking block (the constraint applies to the
        answer, not to the reasoning; the blanks bound what a small model may pad)."""
        body = re.sub(r"^start(?=\s*:)", "answer", self.source, flags=re.M)
        return replace(self, source="start: think BLANK? answer\n"
                                    "think[lazy]: /(?s:.*)<\\/think>/\n"
                                    "BLANK: /[ \\t\\r\\n]{1,3}/\n" + body,
                       label=self.label + " after thinking", vocabulary=None, compiled=None)

    def acceptor(self):
        """A function of an answer's tokens, given one at a time in order (stop tokens not),
        saying whether the answer is complete after each: a copy of the compiled matcher,
        beside the loop's own."""
        matcher = self.matcher()
        return lambda token: matcher.consume_token(token) and matcher.is_accepting()

    def matcher(self):
        """A fresh matcher: a copy of the one :meth:`bind` compiled."""
        if self.compiled is None:
            raise RequestError(self.param, "the grammar is not bound to a tokenizer (make "
                                           "the request with api.make_request)")
        return self.compiled.deep_copy()

    def _compile(self, work, *args):
        """``work(*args)`` in a compiler, the size checked first; llguidance's refusal as a
        GrammarError."""
        limits.check_size(self.source, self.label, self.param)
        done = limits.compiled(work, *args, label=self.label, param=self.param)
        if isinstance(done, str):
            raise GrammarError(self.param, f"{self.label}: {_whole(done)}")
        return done


def _whole(message: str) -> str:
    """llguidance's message, every line of it, but the lines of its excerpt of the grammar
    cut to 200 characters (a schema's grammar is one line as long as the schema) and the
    mark of what non-verbose errors leave out."""
    return "\n".join(line if len(line) <= 200 else line[:199] + "…"
                     for line in message.rstrip().splitlines() if line != "<non-verbose/>")


def _validated(source: str, vocab=None) -> str | None:
    """llguidance's error for ``source`` (None: valid); a compiler's work."""
    error, messages = _ll().LLMatcher.validate_grammar_with_warnings(
        source, vocab, limits=limits.parser_limits())
    return messages[0] if error else None


def _matcher(source: str, vocab):
    """A matcher of ``source`` over ``vocab`` with its first mask computed, or llguidance's
    error; a compiler's work."""
    matcher = _ll().LLMatcher(vocab, source, log_level=0, limits=limits.parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher.get_error() if matcher.is_error() else matcher


def _checked(source: str, label: str, param: str) -> Grammar:
    grammar = Grammar(source, label, param)
    grammar._compile(_validated, source)
    return grammar


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


def _json(schema: dict, param: str = "grammar", label: str = "JSON schema") -> str:
    """A Lark item matching JSON valid against ``schema``, written compactly; a schema within
    the limits (its size checked before its nesting, which takes a walk through it)."""
    try:
        text = json.dumps({**schema, "x-guidance": _COMPACT})
    except RecursionError:      # nested far past the limit, which check_schema names
        limits.check_schema(schema, label, param)
        raise
    except (TypeError, ValueError) as e:
        raise RequestError(param, f"a JSON schema must be JSON: {e}") from None
    limits.check_size(text, label, param)
    limits.check_schema(schema, label, param)
    return f"%json {text}"


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
    raise RequestError("grammar", f"grammar must be a mlx_dspark.grammar.grammars.Grammar or a JSON "
                                  f"schema (dict), not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Nemotron's tool calls:
#   <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
# String values are raw text, as the chat template writes them and tools.typed reads them (no
# "<", within minLength and maxLength characters, or one of an enum); others are JSON typed by
# the parameter's schema. Parameters come in the schema's order, the required ones always.
# Whatever a schema says that these rules do not enforce is refused, never dropped.

_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")
# Keywords that would hold a call to more than its rules do: refused, never dropped. Any other
# keyword is enforced, or an annotation (as JSON Schema reads a keyword it does not know). A
# parameters object's rules allow its declared parameters only, the required ones always.
_APPLICATORS = {"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
                "$recursiveRef"}
_UNENFORCED_OBJECT = _APPLICATORS | {"enum", "const", "minProperties", "maxProperties",
                                     "patternProperties", "propertyNames", "dependentRequired",
                                     "dependentSchemas", "dependencies"}
# A raw-text parameter's rule holds enum, const and the lengths, not a regular expression.
_UNENFORCED_TEXT = _APPLICATORS | {"pattern", "format"}
# tools.read_call reads a value up to the first of these: a value holding one is read cut.
_CLOSINGS = ("</parameter>", "</function>", "</tool_call>")


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
    schemas = [_parameters(f, param) for f in functions]
    count = sum(len(properties) for properties, _ in schemas)
    if count > limits.MAX_TOOL_PARAMETERS:
        raise RequestError(param, f"the tools have {count} parameters, more than the limit "
                                  f"of {limits.MAX_TOOL_PARAMETERS} for a forced tool call")
    rules, firsts = [], []
    for i, (f, schema) in enumerate(zip(functions, schemas)):
        opening = f"<tool_call>\n<function={f['name']}>\n"
        rules += [f"f{i}: {json.dumps(opening)} b{i}", *_body_rules(i, f["name"], *schema,
                                                                      param)]
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


def _parameters(f: dict, param: str) -> tuple[dict, list]:
    """A function's parameters (name -> schema) and the required names, checked."""
    if not _NAME.match(f["name"]):
        raise RequestError(param, f"function name {f['name']!r}: use letters, digits, _ . : -")
    where = f"{f['name']}'s parameters"
    schema = f.get("parameters")
    schema = {} if schema is None else schema
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise RequestError(param, f"{where} must be a JSON schema of type 'object'")
    _refuse_unenforced(schema, _UNENFORCED_OBJECT, where, param)
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not all(isinstance(s, dict)
                                                   for s in properties.values()):
        raise RequestError(param, f"{where}: 'properties' must map each name to a schema "
                                  f"object")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise RequestError(param, f"{where}: 'required' must be an array of parameter names, "
                                  f"not {json.dumps(required)[:60]}")
    for key in properties:
        if not _NAME.match(key):
            raise RequestError(param, f"{where}: parameter name {key!r}: use letters, digits, "
                                      f"_ . : -")
    for key in required:
        if key not in properties:
            raise RequestError(param, f"{where}: {key!r} is required but not among "
                                      f"'properties'")
    return properties, required


def _refuse_unenforced(schema: dict, keywords: set, where: str, param: str):
    held = sorted(keywords & set(schema))
    if held:
        raise RequestError(param, f"{where}: {held[0]!r} is not enforced in a forced tool "
                                  f"call; leave it out, or let the model choose "
                                  f"(tool_choice \"auto\")")


def _body_rules(i: int, function: str, properties: dict, required: list,
                param: str) -> list[str]:
    """Rule ``b{i}``: a call's parameters and its closing tags."""
    parts, rules = [], []
    for j, (key, spec) in enumerate(properties.items()):
        rule, where = f"f{i}p{j}", f"{function}'s parameter {key!r}"
        head = json.dumps(f"<parameter={key}>\n")
        close = json.dumps("\n</parameter>\n")
        if _is_text(spec, where, param):
            rules += _text_rules(rule, head, close, spec, where, param)
        else:
            rules.append(f"{rule}: {head} {_json(spec, param, where)} {close}")
        parts.append(rule if key in required else f"{rule}?")
    rules.insert(0, f"b{i}: {' '.join(parts)} \"</function>\\n</tool_call>\"")
    return rules


def _is_text(spec: dict, where: str, param: str) -> bool:
    """A parameter written as raw text (tools.typed reads it back as written): typed string
    only. Typed string or something else, a raw text and a JSON value could read alike."""
    kinds = spec.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds and len(kinds) > 1:
        raise RequestError(param, f"{where}: a type of string or {sorted(kinds - {'string'})} "
                                  f"cannot be told apart in a tool call, whose strings are "
                                  f"raw text; write anyOf [{{\"type\": \"string\"}}, ...]")
    return kinds == {"string"}


def _text_rules(rule: str, head: str, close: str, spec: dict, where: str,
                param: str) -> list[str]:
    """A raw-text parameter: one of its enum (or const) texts, or text without "<" within
    its lengths."""
    _refuse_unenforced(spec, _UNENFORCED_TEXT, where, param)
    least = _length(spec, "minLength", where, param) or 0
    most = _length(spec, "maxLength", where, param)
    if most is not None and least > most:
        raise RequestError(param, f"{where}: minLength {least} is more than maxLength {most}")
    if "enum" in spec or "const" in spec:
        texts = _texts(spec, least, most, where, param)
        return [f"{rule}: {head} ({' | '.join(map(json.dumps, texts))}) {close}"]
    count = f"{{{least},{'' if most is None else most}}}"
    return [f"{rule}: {head} {rule.upper()}",
            f"{rule.upper()}: /[^<]{count}\\n<\\/parameter>\\n/"]


def _length(spec: dict, key: str, where: str, param: str) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float)
                                       and value.is_integer()) or value < 0:
        raise RequestError(param, f"{where}: {key} must be a non-negative integer, not "
                                  f"{json.dumps(value)}")
    return int(value)


def _texts(spec: dict, least: int, most: int | None, where: str, param: str) -> list[str]:
    """The texts an enum (and a const) allow a string parameter: its strings within the
    lengths, each of which must read back whole."""
    values = spec["enum"] if "enum" in spec else [spec["const"]]
    if not isinstance(values, list):
        raise RequestError(param, f"{where}: enum must be an array")
    texts = [v for v in values if isinstance(v, str) and least <= len(v)
             and (most is None or len(v) <= most) and spec.get("const", v) == v]
    if not texts:
        raise RequestError(param, f"{where}: no string satisfies its type, enum, const and "
                                  f"lengths at once")
    for text in texts:
        closing = next((c for c in _CLOSINGS if c in text), None)
        if closing is not None:
            raise RequestError(param, f"{where}: {text!r} holds {closing!r}, which would end "
                                      f"the value in a tool call")
    return texts


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
        self.matcher = grammar.matcher()     # compiled once, off this thread
        self.stops = sorted(t for t in stop_tokens if t < vocab_size)
        if not self.stops:
            raise RequestError("grammar", "a constrained generation ends on a stop token, and "
                                          "this request has none")
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.words = np.zeros((grammar.vocabulary.vocab_size + 31) // 32, dtype=np.int32)
        self.drafted = 0         # drafts consumed in this round (rolled back if rejected)
        self.halted = False      # a stop token was drafted: later drafts are never emitted
        self.masks = []          # this round's masks, row j after the first j drafts

    def _check(self):
        """A limit of llguidance reached while decoding (a lexer or parser step too
        costly), as a GrammarError with its whole message."""
        if self.matcher.is_error():
            g = self.grammar
            raise GrammarError(g.param, f"{g.label}: {_whole(self.matcher.get_error())}")

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
