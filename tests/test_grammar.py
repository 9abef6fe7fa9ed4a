"""Grammar-constrained decoding composed with speculation (decode/grammar.py, and the
constraint the loop follows, decode/constraint.py).

* Constrained speculative greedy output is constrained serial greedy output, token for token,
  in every mode and for num_draft 1..7 (the demo pair, its real drafter), and a seeded
  ``sampling="reproducible"`` run is the same in every mode.
* Constrained speculative sampling is exact in distribution: a random toy target and drafter
  on an 8-token vocabulary under a small grammar, the loop's first three tokens counted over
  many seeds against the product of masked, warped target rows computed in float64 NumPy.
* On the demo pair every ``json_schema`` answer parses and validates against its schema
  (``jsonschema``, a test dependency), and forced tool calls carry arguments that validate.
"""

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

import mlx_dspark as md
from mlx_dspark.grammar import grammars as G
from mlx_dspark.request import Request, RequestError
from mlx_dspark.logits.sampling import Sampler, constrain, gumbel_max
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from testkit.toy import random_drafter, tiny_target

from test_sampling_acceptance import chi2_pvalue, warp64

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
LIST = {"type": "object", "required": ["items"], "additionalProperties": False,
        "properties": {"items": {"type": "array", "maxItems": 3,
                                 "items": {"type": "integer", "maximum": 999}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                  "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "maxLength": 8}}}}}
PROMPTS = ["def f(x):", "import json\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def pair():
    return md.load()


def run(pair, prompt, **kw):
    return md.generate(pair, prompt, **{"max_tokens": 40, **kw})


# ---------------------------------------------------------------------------------------------
# Speculative = serial, token for token


@pytest.mark.parametrize("num_draft", range(1, 8))
def test_constrained_speculative_greedy_equals_constrained_serial_greedy(pair, num_draft):
    for i, constraint in enumerate([
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            {"grammar": G.tool_calls([WEATHER, CLOCK])}]):
        prompt = PROMPTS[(num_draft + i) % len(PROMPTS)]
        serial = run(pair, prompt, speculative="off", **constraint)
        for mode in ("on", "auto"):
            spec = run(pair, prompt, speculative=mode, num_draft=num_draft, **constraint)
            assert spec.tokens == serial.tokens, (mode, num_draft, spec.text, serial.text)
            assert spec.finish_reason == serial.finish_reason
            assert spec.stats.rounds > 0 or mode == "auto"


@pytest.mark.parametrize("num_draft", [1, 4, 7])
def test_reproducible_sampling_under_a_grammar_gives_the_same_tokens_in_every_mode(pair,
                                                                                  num_draft):
    kw = dict(response_format={"type": "json_schema", "json_schema": {"schema": LIST}},
              temperature=1.0, top_p=0.95, sampling="reproducible", seed=7 + num_draft)
    serial = run(pair, "def f(x):", speculative="off", **kw)
    on = run(pair, "def f(x):", speculative="on", num_draft=num_draft, **kw)
    assert on.tokens == serial.tokens
    assert on.stats.rounds > 0
    assert run(pair, "def f(x):", speculative="on", num_draft=num_draft, **kw).tokens \
        == on.tokens


def test_a_round_rolls_the_matcher_back_over_rejected_drafts(pair):
    """With the real drafter some drafts are rejected (accepted < drafted); the matcher
    then stands where serial decoding's does, or the next masks (and tokens) would differ."""
    kw = dict(response_format={"type": "json_object"}, max_tokens=60)
    spec = run(pair, "import os\n", speculative="on", num_draft=5, **kw)
    assert spec.stats.accepted < spec.stats.drafted
    assert spec.tokens == run(pair, "import os\n", speculative="off", **kw).tokens


# ---------------------------------------------------------------------------------------------
# Answers that validate


@pytest.mark.parametrize("schema", [PERSON, LIST], ids=["person", "list"])
@pytest.mark.parametrize("speculative", ["off", "on"])
def test_every_json_schema_answer_of_the_demo_pair_validates(pair, schema, speculative):
    for prompt in PROMPTS:
        for seed in (None, 3):
            r = run(pair, prompt, max_tokens=80, speculative=speculative,
                    temperature=0.0 if seed is None else 1.0, seed=seed,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": schema,
                                                     "strict": True}})
            assert r.finish_reason == "stop", r.text
            jsonschema.validate(json.loads(r.text), schema)


def test_json_object_answers_are_json_objects(pair):
    r = run(pair, "def f(x):", max_tokens=120, response_format={"type": "json_object"},
            grammar=None, temperature=1.0, seed=1)
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    assert r.text.startswith("{")


CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n(.*?)</function>\n</tool_call>", re.S)
PARAM = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)


def parse_calls(text, tools):
    """Nemotron's calls, arguments typed by the function's schema (strings raw, else JSON)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = []
    for name, body in CALL.findall(text):
        props = schemas[name]["properties"]
        args = {k: v if props[k].get("type") == "string" else json.loads(v)
                for k, v in PARAM.findall(body)}
        calls.append((name, args))
    return calls


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_forced_tool_calls_of_the_demo_pair_carry_arguments_that_validate(pair, speculative):
    tools = [WEATHER, CLOCK]
    for prompt, seed in zip(PROMPTS, (None, 1, 2)):
        r = run(pair, prompt, max_tokens=120, speculative=speculative,
                temperature=0.0 if seed is None else 1.0, seed=seed,
                grammar=G.tool_calls(tools, parallel=False))
        assert r.finish_reason == "stop", r.text
        calls = parse_calls(r.text, tools)
        assert len(calls) == 1 and CALL.fullmatch(r.text), r.text
        name, args = calls[0]
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[name]
        jsonschema.validate(args, schema)
    named = run(pair, "x = 1\n", max_tokens=120, speculative=speculative,
                grammar=G.tool_calls(tools, name="get_time", parallel=False))
    assert [n for n, _ in parse_calls(named.text, tools)] == ["get_time"]


def test_a_stop_token_ends_a_constrained_answer_only_where_the_grammar_is_complete():
    tokenizer = TinyTokenizer()
    c = G.Constraint(G.lark('start: "ab"').bind(tokenizer, 8), {EOS}, 8)
    assert not np.array(c.mask())[EOS]
    c.advance(A)
    assert not np.array(c.mask())[EOS]
    c.advance(B)
    assert np.array(c.mask()).nonzero()[0].tolist() == [EOS]


# ---------------------------------------------------------------------------------------------
# Exact in distribution: a tiny vocabulary, a small grammar


PIECES = ["a", "b", "c", "[", "]", ",", "</s>", "<mask>"]     # the drafter's mask id is 7
A, B, EOS = 0, 1, 6
SMALL = r"start: /(a|b[ac]*)(,(a|b[ac]*))*/"


class TinyTokenizer:
    """Eight tokens, one character each: what grammar.vocabulary reads of a tokenizer."""

    eos_token_ids = [EOS]

    def __init__(self):
        tok = Tokenizer(models.BPE({p: i for i, p in enumerate(PIECES)}, [], unk_token="<mask>"))
        tok.add_special_tokens([AddedToken("</s>", special=True),
                                AddedToken("<mask>", special=True)])
        tok.decoder = decoders.ByteLevel()
        self.backend_tokenizer = tok


@pytest.fixture(scope="module")
def toy():
    target = tiny_target(vocab_size=len(PIECES))
    return target, random_drafter(target), G.lark(SMALL).bind(TinyTokenizer(), len(PIECES))


def allowed64(prefix):
    """The grammar's next-token set after ``prefix``, from Python's re: a character whose
    text is still a prefix of the language, and the stop token where the text is in it."""
    text = "".join(PIECES[t] for t in prefix)
    ok = [t for t in range(6) if re.fullmatch(r"((a|b[ac]*),)*(a|b[ac]*)?", text + PIECES[t])]
    return ok + [EOS] * bool(re.fullmatch(r"(a|b[ac]*)(,(a|b[ac]*))*", text))


def exact_first_three(target, s: Sampler, prompt):
    """P(first three tokens) of serial constrained sampling: products of masked, warped target
    rows (float64), the logits of each prefix from a fresh forward pass."""
    probs = {}

    def walk(prefix, p):
        if len(prefix) == 3 or (prefix and prefix[-1] == EOS):
            probs[tuple(prefix)] = probs.get(tuple(prefix), 0) + p
            return
        logits, _ = target.step(mx.array([prompt + prefix]), target.make_cache())
        row = np.array(logits[0, -1].astype(mx.float32), dtype=np.float64)
        mask = np.full(len(PIECES), -np.inf)
        mask[allowed64(prefix)] = 0
        q = warp64(row + mask, s)
        for t in np.nonzero(q)[0]:
            walk(prefix + [int(t)], p * q[t])

    walk([], 1.0)
    return probs


def first_three_pvalue(toy, scheme, draws=600):
    """Chi-square p-value of the loop's first three tokens (speculative "on", num_draft 3)
    against the exact masked target distribution."""
    target, drafter, grammar = toy
    s, prompt = Sampler(1.0, scheme=scheme), [3, 4]
    exact = exact_first_three(target, s, prompt)
    counts = dict.fromkeys(exact, 0)
    session = Session(target, drafter)
    for seed in range(draws):
        req = Request(tuple(prompt), max_tokens=4, temperature=1.0, sampling=scheme,
                      num_draft=3, speculative="on", seed=seed, stop_tokens={EOS},
                      grammar=grammar)
        out = list(decode(session, req))
        key = tuple(out[:out.index(EOS) + 1] if EOS in out[:3] else out[:3])
        counts[key] += 1                  # a key outside ``exact`` breaks the grammar: KeyError
    keys = sorted(exact, key=exact.get)
    expected = np.array([exact[k] for k in keys]) * draws
    observed = np.array([counts[k] for k in keys], dtype=float)
    # merge the rare outcomes so every expected count is at least 5
    small = np.cumsum(expected) < 5 * 2
    observed = np.concatenate([[observed[small].sum()], observed[~small]])
    expected = np.concatenate([[expected[small].sum()], expected[~small]])
    if expected[0] == 0:
        observed, expected = observed[1:], expected[1:]
    return chi2_pvalue(observed, expected)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["rejection", "reproducible"])
def test_constrained_speculative_sampling_reproduces_the_masked_target_distribution(toy,
                                                                                     scheme):
    assert first_three_pvalue(toy, scheme) > 1e-3


@pytest.mark.slow
def test_the_chi_square_test_fails_when_the_draft_distribution_is_not_the_masked_one(
        toy, monkeypatch):
    """Drafts drawn under the mask but reported with their unmasked logits (q too small on
    the allowed tokens) bias rejection sampling: the test has teeth."""
    from mlx_dspark.logits import draw as D
    held = {}

    def report_unmasked(z, allowed):
        held["allowed"] = allowed
        return z

    def draw_masked(z, *options):
        return gumbel_max(constrain(z, held["allowed"]), *options)

    monkeypatch.setattr(D, "constrain", report_unmasked)
    monkeypatch.setattr(D, "gumbel_max", draw_masked)
    assert first_three_pvalue(toy, "rejection", draws=300) < 1e-3     # ~1e-40 measured


def test_the_reference_grammar_set_matches_llguidance(toy):
    """allowed64 (a regex) and the engine agree on every prefix the exact test walks."""
    _, _, grammar = toy
    for prefix in ([], [A], [B], [B, 2], [A, 5], [B, A, 5], [A, 5, B]):
        c = G.Constraint(grammar, {EOS}, len(PIECES))
        for t in prefix:
            c.advance(t)
        assert np.array(c.mask()).nonzero()[0].tolist() == sorted(allowed64(prefix)), prefix


# ---------------------------------------------------------------------------------------------
# Refusals


def test_grammar_refusals_name_the_parameter(pair):
    with pytest.raises(RequestError) as e:
        Request((1, 2), grammar="{}")
    assert e.value.param == "grammar"
    with pytest.raises(RequestError) as e:
        md.generate(pair, "x", response_format={"type": "xml"})
    assert e.value.param == "response_format"
    with pytest.raises(RequestError) as e:
        md.generate(pair, "x", response_format={"type": "json_object"}, grammar=PERSON)
    assert e.value.param == "grammar"
    with pytest.raises(RequestError) as e:
        G.tool_calls([WEATHER], name="nope")
    assert e.value.param == "tool_choice"
    with pytest.raises(RequestError) as e:
        G.lark("start: foo")
    assert e.value.param == "grammar"


def test_a_prompt_that_opens_a_thinking_block_is_constrained_after_it(pair):
    """Reasoning first, free; the grammar holds from the first ``</think>`` on."""
    request = md.api.make_request(pair, "Think first.\n<think>\n", 40,
                                  response_format={"type": "json_object"})
    assert request.grammar.label.endswith("after thinking")
    c = G.Constraint(request.grammar, request.stop_tokens, 4096)
    for t in pair.tokenizer.encode('x = [1, 2]</think>{"a":[1]}', add_special_tokens=False):
        c.advance(t)
    assert c.matcher.is_accepting()
    plain = md.api.make_request(pair, "No thinking.\n", 40,
                                response_format={"type": "json_object"})
    assert plain.grammar.label == "JSON object"


@pytest.mark.parametrize("budget", [0, 6])
def test_a_thinking_budget_closes_the_block_and_the_answer_still_follows_the_grammar(pair,
                                                                                   budget):
    """The engine's closing ids go through the matcher too: the answer after them validates,
    and speculative decoding gives serial decoding's tokens."""
    messages = [{"role": "user", "content": "Give a person as JSON."}]
    kw = dict(chat=True, chat_template_kwargs={"enable_thinking": True}, max_tokens=80,
              thinking_token_budget=budget,
              response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    serial = md.generate(pair, messages, speculative="off", **kw)
    spec = md.generate(pair, messages, speculative="on", num_draft=4, **kw)
    assert spec.tokens == serial.tokens
    assert serial.finish_reason == "stop", (serial.reasoning, serial.text)
    jsonschema.validate(json.loads(serial.text), PERSON)
