"""Stop strings in streamed text (stops.py): the same cut as reading the whole text, whatever
the pieces; and a bounded cost per token, counted (no clock): the text already shown is never
read again, however long it is and however many stop strings there are."""

from __future__ import annotations

import random

import mlx_dspark as md
from mlx_dspark import api
from mlx_dspark.text.stops import StopScanner


def whole(text: str, stops) -> tuple[str, str | None]:
    """The oracle: the text up to the first stop string completed (the longest of those
    completed at the same character), and that string."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.endswith(s, 0, end)]
        if done:
            s = max(done, key=len)
            return text[:end - len(s)], s
    return text, None


def streamed(pieces, stops) -> tuple[str, str | None, list[int]]:
    """What a stream shows of ``pieces`` (shown text, stop string, held-back length each
    time), fed as _chunks feeds the scanner."""
    scanner, text, shown, held = StopScanner(stops), "", 0, []
    for piece in pieces:
        text += piece
        end, stop = scanner.scan(text[shown:])
        if stop is not None:
            return text[:shown + end], stop, held
        shown += end
        held.append(len(text) - shown)
    return text, None, held


def longest_open_end(text: str, stops) -> int:
    """How much of the end of ``text`` could still begin a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
               default=0)


def test_streamed_pieces_cut_where_the_whole_text_does_and_hold_back_only_open_ends():
    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(len(text) - 1, 0))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        shown, stop, held = streamed(pieces, stops)
        assert (shown, stop) == whole(text, stops), (pieces, stops)
        if stop is None:                # held back exactly what could still become a stop
            ends = [sum(map(len, pieces[:i + 1])) for i in range(len(pieces))]
            assert held == [longest_open_end(text[:e], stops) for e in ends], (pieces, stops)


def test_a_stop_string_met_in_pieces_or_whole_ends_the_text_the_same_way():
    stops = ["abcd", "bc"]              # "bc" is completed first, whatever the pieces
    assert streamed(["abcd"], stops)[:2] == streamed(["ab", "c", "d"], stops)[:2] == ("a", "bc")
    assert streamed(["xaab"], ["aab"])[:2] == ("x", "aab")
    assert streamed(["xa", "a", "a", "b"], ["aab"])[:2] == ("xa", "aab")


class _Counted(list):
    """A list that counts its reads: the automaton's work, without a clock."""

    reads = 0

    def __getitem__(self, i):
        _Counted.reads += 1
        return super().__getitem__(i)


def test_a_tokens_scan_costs_its_held_back_text_and_new_characters_never_the_whole_text():
    longest = 100
    stops = ["a" * (longest - 1) + "b", "a" * (longest - 2) + "ba", "ab" * (longest // 2),
             "x" * longest]                    # held back the whole way by a text of "a"s
    scanner = StopScanner(stops)
    scanner._fail, scanner._next = _Counted(scanner._fail), _Counted(scanner._next)
    text, shown, work = "", 0, []
    for i in range(4000):
        text += "a"
        tail = text[shown:]
        before = _Counted.reads
        end, stop = scanner.scan(tail)
        assert stop is None
        shown += end
        work.append((_Counted.reads - before, len(tail)))
    assert max(n for _, n in work) <= longest                 # never more than one stop's
    assert all(reads <= 8 * (tail + longest) for reads, tail in work)
    # as much work late in a 4,000-character text as early in it
    assert max(r for r, _ in work[-100:]) <= 2 * max(r for r, _ in work[100:200])


def test_generate_scans_each_token_with_at_most_the_longest_stop_string_held_back(
        monkeypatch):
    pair = md.load()
    seen = []
    scan = StopScanner.scan
    monkeypatch.setattr(StopScanner, "scan", lambda self, tail: seen.append(len(tail))
                        or scan(self, tail))
    longest_token = max(map(len, pair.tokenizer.get_vocab()))
    never = ["\x01" * 40, "    " * 10 + "\x01"]   # indentation is held back, then shown
    full = api.generate(pair, "import os\n\nclass Config:\n", max_tokens=100, temperature=0)
    res = api.generate(pair, "import os\n\nclass Config:\n", max_tokens=100, temperature=0,
                       stop=never)
    assert res.text == full.text and len(seen) >= len(res.tokens) > 50
    assert max(seen) < 41 + 2 * longest_token
