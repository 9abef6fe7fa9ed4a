"""The thinking block: told apart from the answer on exact strings and in streamed pieces, and
a thinking budget that holds inside the speculative loop (the end-of-thinking ids emitted by
the engine, the state after them that of the same tokens decoded, speculative == serial)."""

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.text import reasoning
from mlx_dspark.api import Pair
from mlx_dspark.request import Request, RequestError, Thinking
from testkit.scripted import ScriptedTarget

THINK_ON = {"enable_thinking": True}
QUESTION = [{"role": "user", "content": "Sort a list of numbers in Python."}]


@pytest.mark.parametrize("text,want", [
    ("plan</think>\n\nanswer", ("plan", "answer")),
    ("a</think>b</think>c", ("a", "bc")),        # the first tag closes, a stray one is dropped
    ("still thinking <", ("still thinking <", "")),           # a tag never finished
    ("</think>", ("", "")),
    ("x </thin k> y", ("x </thin k> y", "")),
])
def test_split_cuts_at_the_first_closing_tag(text, want):
    assert reasoning.split(text) == want


@pytest.mark.parametrize("text,want", [
    ("Fix the parser.</think>", ("", "Fix the parser.")),       # aider's commit message
    ("a </think>b <think> c", ("", "a b  c")),                  # mid-answer tags dropped
    ("<think>plan</think>\nanswer", ("plan", "answer")),         # a reply that opens a block
    ("\n<think>plan</think>\n\nanswer", ("plan", "\nanswer")),  # (whitespace before it stays)
    ("\n    return x", ("", "\n    return x")),                # an answer's newlines stay
    ("<think>never closed", ("never closed", "")),
    ("a < b, <th", ("", "a < b, <th")),                         # not tags: kept
])
def test_a_tag_outside_an_open_block_never_reaches_the_answer(text, want):
    assert reasoning.split(text, thinking=False) == want


def test_inside_an_open_block_a_closing_tag_still_closes_it_and_an_opening_one_is_thought():
    assert reasoning.split("p<think>q</think>r</think>") == ("p<think>q", "r")


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("text", ["plan</think>\n\nanswer", "a</th</think>\nb", "<</think>",
                                  "no tag here </thi", "x</think>y<think>z", "<think>t</think>a",
                                  "<<think>", "a <thi"])
def test_streamed_pieces_join_to_the_whole_split_at_every_cut(text, thinking):
    want = reasoning.split(text, thinking)
    for cut in range(len(text) + 1):
        s = reasoning.Splitter(thinking)
        pieces = [s.add(text[:cut]), s.add(text[cut:]), s.finish()]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == want, cut
    one_by_one = reasoning.Splitter(thinking)
    pieces = [one_by_one.add(c) for c in text] + [one_by_one.finish()]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == want


def test_a_prompt_closes_thinking_when_it_ends_with_an_empty_block():
    assert reasoning.closes_thinking("<|im_start|>assistant\n<think></think>")
    assert reasoning.closes_thinking("<|assistant|>\n<think>\n</think>\n")
    assert not reasoning.closes_thinking("<think>\nplan\n</think>")      # a past thought
    assert not reasoning.closes_thinking("<|im_start|>assistant\n<think>\n")
    assert not reasoning.closes_thinking("plain completion")


def test_a_prompt_opens_thinking_only_when_it_ends_inside_the_block():
    assert reasoning.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not reasoning.opens_thinking("<|im_start|>assistant\n<think></think>")
    assert not reasoning.opens_thinking("<think>\nplan\n</think>\nanswer <|im_start|>user\n")
    assert not reasoning.opens_thinking("plain completion")


def test_a_negative_budget_is_refused_naming_the_field():
    with pytest.raises(RequestError) as e:
        Request([1, 2], thinking_token_budget=-1, thinking=Thinking((5,), (6,)))
    assert e.value.param == "thinking_token_budget"


# -- on the demo pair ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return md.load(dtype=mx.float32)


def test_the_demo_template_opens_and_closes_thinking_as_asked(pair):
    on = md.api.make_request(pair, QUESTION, chat_template_kwargs=THINK_ON)
    off = md.api.make_request(pair, QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert on.thinking is not None and off.thinking is None
    assert pair.tokenizer.decode(on.thinking.end) == reasoning.END


def test_thinking_that_uses_up_max_tokens_says_length_and_leaves_no_answer(pair):
    # The chat-tuned demo target closes its thinking block at once ('</', 'th', 'in', 'k',
    # '>' are its first tokens), so 4 tokens end the reply inside the closing tag: still
    # thinking, the partial tag is reasoning and there is no answer.
    res = md.generate(pair, QUESTION, max_tokens=4, chat_template_kwargs=THINK_ON)
    assert res.finish_reason == "length" and res.text == ""
    assert res.reasoning == pair.tokenizer.decode(res.tokens)


@pytest.mark.parametrize("budget", [0, 1, 3])   # under 5: the demo target closes by itself at 5
def test_the_budget_closes_the_block_and_the_model_answers(pair, budget):
    res = md.generate(pair, QUESTION, max_tokens=30, chat_template_kwargs=THINK_ON,
                      thinking_token_budget=budget, speculative=False)
    end = list(md.api.make_request(pair, QUESTION, chat_template_kwargs=THINK_ON).thinking.end)
    assert res.tokens[budget:budget + len(end)] == end
    assert len(res.tokens) == 30 and res.stats.generated == 30
    assert res.reasoning == pair.tokenizer.decode(res.tokens[:budget]) + "\n"
    assert res.text                                  # the model goes on to answer


@pytest.mark.parametrize("num_draft", [1, 3])
def test_a_budgeted_reply_decodes_the_same_speculative_and_serial(pair, num_draft):
    kw = dict(max_tokens=40, chat_template_kwargs=THINK_ON, thinking_token_budget=6)
    serial = md.generate(pair, QUESTION, speculative=False, **kw)
    spec = md.generate(pair, QUESTION, speculative=True, num_draft=num_draft, **kw)
    assert spec.tokens == serial.tokens and spec.stats.rounds > 0
    assert (spec.reasoning, spec.text) == (serial.reasoning, serial.text)


def test_seeded_sampling_with_a_budget_reproduces_in_every_mode(pair):
    kw = dict(max_tokens=30, chat_template_kwargs=THINK_ON, thinking_token_budget=4,
              temperature=0.9, seed=7, sampling="reproducible")
    runs = [md.generate(pair, QUESTION, speculative=mode, **kw).tokens
            for mode in (False, True, False)]
    assert runs[0] == runs[1] == runs[2]
    assert md.generate(pair, QUESTION, speculative=False, **dict(kw, seed=8)).tokens != runs[0]


def test_after_the_budget_the_state_is_that_of_the_same_tokens(pair):
    """The engine-fed end of thinking leaves target and drafter as a fresh run over the same
    tokens: continuing the session gives what a cold start on the whole sequence gives."""
    request = md.api.make_request(pair, QUESTION, max_tokens=20, chat_template_kwargs=THINK_ON,
                                  thinking_token_budget=3)
    session = pair.session()
    budgeted = md.generate(pair, request, session=session)
    seq = list(request.prompt) + budgeted.tokens
    follow = seq + budgeted.tokens[-1:]             # any extension of what the session holds
    warm = md.generate(pair, follow, max_tokens=12, speculative=True, session=session)
    cold = md.generate(pair, follow, max_tokens=12, speculative=True)
    assert warm.stats.reused_tokens == len(seq) - 1 and warm.tokens == cold.tokens
    # and the answer after the end ids is the one a prompt holding them gets
    end = len(request.prompt) + 3 + len(request.thinking.end)
    rest = md.generate(pair, seq[:end], max_tokens=20 - (end - len(request.prompt)),
                       speculative=False)
    assert rest.tokens == seq[end:]


def test_a_model_that_closes_its_block_within_budget_gets_nothing_inserted(pair):
    tok = pair.tokenizer
    reply = tok.encode("short plan\n</think>\nThe answer.", add_special_tokens=False)
    scripted = Pair(ScriptedTarget(4096, lambda ids: reply, tok.eos_token_id), None, tok)
    free = md.generate(scripted, QUESTION, max_tokens=60, chat_template_kwargs=THINK_ON)
    capped = md.generate(scripted, QUESTION, max_tokens=60, chat_template_kwargs=THINK_ON,
                         thinking_token_budget=len(reply) - 2)
    assert free.tokens == capped.tokens == reply
    assert (free.reasoning, free.text) == ("short plan\n", "The answer.")
    assert capped.finish_reason == free.finish_reason == "stop"
