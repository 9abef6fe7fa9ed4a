"""The speculative decoding loop (docs/design.md §7), one short function per step.

    prefill  -> the prompt through the target (taps queued for the drafter), first token
    per round:
      catch up the drafter gets the taps of tokens it has not seen (prompt, serial steps)
      draft    d1..dN = drafter.propose(bonus, N)             (+ the draft distributions)
      verify   target over [bonus, d1..dN] in one pass        -> p_0..p_N, taps
      accept   coupled match (same Gumbel noise) / rejection  -> a accepted, next token
      commit   target keeps bonus, d1..da (exact rollback); their taps go to the drafter

A serial step is the same machinery with no drafts. The break-even controller decides, before
each step, which of the two to run. ``decode`` yields tokens one at a time; stop tokens and
``max_tokens`` are applied here so that the target and drafter state after a stop is the same
as after serial decoding (the stop token is emitted, never fed)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import mlx.core as mx
from mlx.utils import tree_flatten

from . import sampling
from .controller import Controller


class Cache(Protocol):
    def arrays(self) -> list[mx.array]:
        """Every array the cache holds (evaluated after a commit)."""

    def mark(self):
        """A restore point (no copies)."""

    def rewind(self, mark):
        """Forget every step taken since ``mark``."""


class Target(Protocol):
    """What the loop calls on a target (target.NemotronH; ARCHITECTURE.md, "The target")."""

    context_limit: int | None     # longest sequence the model takes, if it declares one
    config: object                # its config.vocab_size bounds the token ids

    def make_cache(self) -> Cache: ...

    def step(self, tokens: mx.array, cache: Cache, tap_layers=None):
        """Feed ``tokens [1, T]``; returns ``(logits [1, T, V], taps [T, n*hidden] or None)``."""

    def verify(self, tokens: mx.array, cache: Cache, tap_layers=None):
        """A step that ``commit`` can cut back to any prefix."""

    def commit(self, cache: Cache, n: int):
        """Keep the first ``n`` positions of the last verify (exact rollback of the rest)."""


class Drafter(Protocol):
    """What the loop calls on a drafter (drafter.Drafter; ARCHITECTURE.md)."""

    target_layer_ids: list[int]   # the target layers whose outputs feed add_context
    max_draft: int                # most tokens one propose() drafts

    def reset(self): ...

    def add_context(self, taps: mx.array, start_pos: int): ...

    def propose(self, bonus, n: int, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, noise: mx.array | None = None):
        """Lazy ``(tokens [n], logits [n, V])``: the drafts, drawn as
        ``argmax(log warp(logits) + noise)`` (argmax without noise), and their logits."""

    def state(self):
        """The context (a tree holding its arrays; ``add_context`` may leave them lazy)."""


@dataclass(frozen=True)
class Sampler:
    """How tokens are chosen; the same warping applies to target and draft distributions.

    ``scheme`` (``sampling.SCHEMES``): "reproducible" gives, for a seed, the same tokens in
    every mode (serial, speculative, auto, any num_draft); "rejection" accepts more drafts
    but reproduces only in distribution. Both are exact samplers of the warped target;
    greedy (temperature 0) is the same in both."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    scheme: str = sampling.DEFAULT_SCHEME

    def __post_init__(self):
        sampling.check_params(self.temperature, self.top_p, self.top_k, self.scheme)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def choose(self, logits: mx.array, noise: mx.array | None) -> mx.array:
        """The token of each row of ``logits`` given its Gumbel noise (None when greedy)."""
        return sampling.gumbel_max(logits, self.temperature, self.top_p, self.top_k, noise)

    def warp(self, logits: mx.array) -> mx.array:
        return sampling.warp(logits, self.temperature, self.top_p, self.top_k)


class Noise:
    """The Gumbel noise of one decode call: by absolute position ("reproducible"), fresh from
    a key split per use ("rejection"), or none (greedy)."""

    def __init__(self, sampler: Sampler, seed: int | None):
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, not {seed!r}")
        self.sampler = sampler
        self.word = sampling.seed_word(seed)
        self.key = mx.random.key(seed % 2 ** 64)

    def next_key(self):
        self.key, sub = mx.random.split(self.key)
        return sub

    def at(self, start: int, n: int, vocab: int) -> mx.array | None:
        """Noise ``[n, vocab]`` for the tokens at positions start..start+n-1."""
        if self.sampler.greedy:
            return None
        if self.sampler.scheme == "reproducible":
            return sampling.position_noise(self.word, start, n, vocab)
        return mx.random.gumbel((n, vocab), key=self.next_key())


@dataclass
class Stats:
    """Counters and wall times of one generation (seconds; token counts exclude the prompt).

    ``accepted`` counts accepted drafts only; ``mean_accepted_per_round`` is accepted drafts
    per round (bonus excluded) and ``mean_tokens_per_round`` the tokens each round emitted
    (bonus included, = mean_accepted + 1 before any stop). A round is one lazy graph read
    once: ``t_draft`` is the drafter's catch-up and building the drafts' graph, ``t_verify``
    building the verify and waiting for the read (the drafter's and the target's compute),
    ``t_rollback`` queuing the commit."""

    prompt_tokens: int = 0
    reused_tokens: int = 0        # prompt tokens a session already held (not prefilled again)
    generated: int = 0
    rounds: int = 0
    serial_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tested_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    switches: int = 0
    t_prefill: float = 0.0
    t_serial: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_rollback: float = 0.0
    t_round: float = 0.0
    mode: str = "serial"          # what the controller was doing at the end
    finish_reason: str | None = None
    predicted_speedup: float | None = None

    def as_dict(self) -> dict:
        decode = self.t_serial + self.t_round
        round_tokens = self.generated - self.serial_steps - (1 if self.generated else 0)
        return {
            "mode": self.mode,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "generated_tokens": self.generated,
            "rounds": self.rounds,
            "serial_steps": self.serial_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_by_position": [a / t if t else None for a, t in
                                       zip(self.accepted_by_position, self.tested_by_position)],
            "tested_by_position": list(self.tested_by_position),
            "mean_accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
            "mean_tokens_per_round": round_tokens / self.rounds if self.rounds else 0.0,
            "mode_switches": self.switches,
            "predicted_speedup": self.predicted_speedup,
            "time": {
                "prefill": self.t_prefill,
                "serial": self.t_serial,
                "draft": self.t_draft,
                "verify": self.t_verify,
                "rollback": self.t_rollback,
                "other": self.t_round - self.t_draft - self.t_verify - self.t_rollback,
            },
            # the first token comes from the prefill; decode speed counts the rest
            "tokens_per_s": (self.generated - 1) / decode if decode > 0 and self.generated > 1
            else 0.0,
            "prompt_tokens_per_s": (self.prompt_tokens - self.reused_tokens) / self.t_prefill
            if self.t_prefill else 0.0,
        }


class Session:
    """Target cache and drafter context of one growing token sequence.

    ``tokens`` are the tokens fed to the target so far. Taps of those tokens reach the drafter
    lazily (``pending``): serial steps only queue them, and the queue is flushed in one
    ``add_context`` call before the next proposal, so "auto" pays almost nothing for keeping the
    drafter ready while it decodes serially. A session may be passed to ``decode`` again with a
    prompt that extends ``tokens`` (a chat's next turn): only the new suffix is prefilled.

    With ``speculative=False`` the session holds no drafter: it is never asked, so it is fed
    no taps. ``home`` keeps the break-even controller (costs, acceptance) across calls: the
    pair that made the session (api.Pair.session), or the session itself."""

    def __init__(self, target: Target, drafter: Drafter | None = None,
                 speculative: bool | str = "auto", home=None):
        self.target = target
        self.drafter = drafter if speculative is not False else None
        self.home = home if home is not None else ControllerHome()
        self.reset()

    @property
    def controller(self) -> Controller | None:
        return self.home.controller

    @controller.setter
    def controller(self, controller: Controller | None):
        self.home.controller = controller

    def reset(self):
        self.cache = self.target.make_cache()
        if self.drafter is not None:
            self.drafter.reset()
        self.tokens: list[int] = []
        self.pending: list[mx.array] = []
        self.pending_start = 0

    @property
    def tap_layers(self):
        return tuple(self.drafter.target_layer_ids) if self.drafter is not None else None

    def feed(self, tokens: list[int], taps: mx.array | None):
        if taps is not None:
            if not self.pending:
                self.pending_start = len(self.tokens)
            self.pending.append(taps)
        self.tokens.extend(tokens)

    def flush(self) -> int:
        """Hand the queued taps to the drafter (lazily); returns how many tokens."""
        if not self.pending:
            return 0
        taps = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending)
        self.drafter.add_context(taps, self.pending_start)
        self.pending = []
        return taps.shape[0]

    def snapshot(self) -> "Snapshot":
        """The state after ``tokens``, to :meth:`restore` later (a server's prefix cache).
        Take it between steps (not between a verify and its commit). Beyond the loop's
        protocols this needs ``cache.snapshot()/restore()`` (target.TargetCache) and
        ``drafter.state()/set_state()`` (drafter.Drafter)."""
        cache = self.cache.snapshot()
        drafter = self.drafter.state() if self.drafter is not None else None
        pending = tuple(self.pending)
        mx.eval(list(pending))
        nbytes = sum(x.nbytes for _, x in tree_flatten([cache, drafter, pending])
                     if isinstance(x, mx.array))
        return Snapshot(tuple(self.tokens), cache, drafter, pending, self.pending_start, nbytes)

    def restore(self, snap: "Snapshot"):
        """Continue from ``snap`` (of a session on the same target and drafter); the
        snapshot stays valid, so it can be restored again."""
        self.cache = self.target.make_cache()
        self.cache.restore(snap.cache)
        if self.drafter is not None:
            self.drafter.set_state(snap.drafter)
        self.tokens = list(snap.tokens)
        self.pending = list(snap.pending)
        self.pending_start = snap.pending_start


@dataclass(frozen=True)
class Snapshot:
    """A session's state after ``tokens`` (:meth:`Session.snapshot`); ``nbytes`` sums its
    arrays (arrays shared with other snapshots are counted in each)."""

    tokens: tuple[int, ...]
    cache: object
    drafter: object
    pending: tuple
    pending_start: int
    nbytes: int


@dataclass
class ControllerHome:
    """Where a session keeps its break-even controller between calls (a Pair is another)."""

    controller: Controller | None = None


# ---------------------------------------------------------------------------------------------
# The steps


def _shared_prefix(session: Session, prompt: list[int]) -> int:
    """How many prompt tokens the session already holds (all of its tokens, or none)."""
    n = len(session.tokens)
    return n if n < len(prompt) and prompt[:n] == session.tokens else 0


def prefill(session: Session, prompt: list[int], tap: bool) -> mx.array:
    """Feed the prompt (or the part the session has not seen) and return the last logits."""
    if session.tokens and not _shared_prefix(session, prompt):
        session.reset()
    new = prompt[len(session.tokens):]
    logits, taps = session.target.step(mx.array([new]), session.cache,
                                       tap_layers=session.tap_layers if tap else None,
                                       last_only=True)
    session.feed(new, taps)
    return logits[0, -1]


def pick(logits: mx.array, sampler: Sampler, noise: Noise, position: int) -> mx.array:
    """Choose the token at ``position`` from one row of target logits (lazy, shape [])."""
    return sampler.choose(logits, noise.at(position, 1, logits.shape[-1]))[0]


def serial_step(session: Session, token, sampler: Sampler, noise: Noise, tap: bool):
    """Feed one token (an int, or the previous step's lazy token), choose the next. Returns
    the lazy next token and the taps; the caller feeds the token once it has read it."""
    position = len(session.tokens) + 1
    logits, taps = session.target.step(mx.array(token, dtype=mx.int32).reshape(1, 1),
                                       session.cache,
                                       tap_layers=session.tap_layers if tap else None)
    return pick(logits[0, -1:], sampler, noise, position), taps


def draft(session: Session, bonus: int, n: int, sampler: Sampler, noise: mx.array | None):
    """The drafter proposes d1..dn after the bonus with ``noise`` [n, V]; lazy tokens and
    logits."""
    return session.drafter.propose(bonus, n, temperature=sampler.temperature,
                                   top_p=sampler.top_p, top_k=sampler.top_k, noise=noise)


def verify(session: Session, bonus: int, drafts: mx.array):
    """One target pass over [bonus, d1..dn] (drafts still lazy): logits [n+1, V] and taps."""
    tokens = mx.concatenate([mx.array([bonus], dtype=mx.int32), drafts.astype(mx.int32)])
    logits, taps = session.target.verify(tokens[None], session.cache,
                                         tap_layers=session.tap_layers)
    return logits[0], taps


def accept(drafts: mx.array, draft_logits: mx.array, target_logits: mx.array,
           sampler: Sampler, noise: mx.array | None, key) -> tuple[mx.array, mx.array]:
    """How many drafts survive, and the token after them (docs/design.md §7 step 3), both lazy.

    ``noise`` is the noise the drafts were drawn with (rows 1..n) plus the row after them:
    the coupled scheme compares each draft with the target's Gumbel-max token under the same
    noise; rejection sampling compares the two warped distributions."""
    if sampler.greedy or sampler.scheme == "reproducible":
        return sampling.accept_coupled(drafts, sampler.choose(target_logits, noise))
    return sampling.accept_rejection(drafts, sampler.warp(target_logits),
                                     sampler.warp(draft_logits), key)


def commit(session: Session, bonus: int, drafts: list[int], taps: mx.array, keep: int):
    """Keep the first ``keep`` verified tokens (bonus, d1..d_{keep-1}); drop the rest."""
    session.target.commit(session.cache, keep)
    mx.async_eval(session.cache.arrays())     # the rollback runs while Python goes on
    session.feed([bonus] + drafts[:keep - 1], taps[:keep])


# ---------------------------------------------------------------------------------------------
# The loop


def decode(target: Target, drafter: Drafter | None, prompt: list[int], *, max_tokens: int, sampler: Sampler = Sampler(),
           num_draft: int = 3, speculative: bool | str = "auto", seed: int | None = None,
           stop_tokens=(), stats: Stats | None = None,
           session: Session | None = None) -> Iterator[int]:
    """Yield up to ``max_tokens`` generated tokens; a stop token is yielded and ends the run.
    ``stats.finish_reason`` is set just before the last token is yielded.

    ``speculative``: "auto" (break-even controller), True (always), False (never; the drafter
    is not touched). ``stats`` (optional) is filled in as the run goes."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    if speculative not in ("auto", True, False):
        raise ValueError(f"speculative must be 'auto', True or False, not {speculative!r}")
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, not {num_draft}")
    vocab = target.config.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
    limit = target.context_limit
    if limit is not None and len(prompt) >= limit:
        raise ValueError(f"prompt has {len(prompt)} tokens; the model's context limit is "
                         f"{limit} (max_position_embeddings), leaving no room to generate")
    if speculative is True and drafter is None:
        raise ValueError("speculative=True needs a drafter")
    if session is None:
        session = Session(target, drafter, speculative)
    if speculative is not False and session.drafter is not None \
            and num_draft > session.drafter.max_draft:
        raise ValueError(f"num_draft {num_draft}: this drafter proposes at most "
                         f"{session.drafter.max_draft} tokens per round")
    stats = stats if stats is not None else Stats()
    stats.tested_by_position = [0] * num_draft
    stats.accepted_by_position = [0] * num_draft
    stats.prompt_tokens = len(prompt)
    tap = session.drafter is not None        # a session with a drafter keeps its context whole
    use_drafter = tap and speculative is not False
    stops = set(stop_tokens)
    forced = None if speculative == "auto" else bool(speculative)
    if forced is None:
        control = session.controller
        if control is None or control.num_draft != num_draft or control.forced is not None:
            control = session.controller = Controller(num_draft)
    else:   # a forced call keeps its estimates to itself: what "auto" learned stays
        control = Controller(num_draft, forced=forced)
    switches_before = control.switches
    noise = Noise(sampler, seed)

    if max_tokens <= 0:
        stats.finish_reason = "length"
        return
    t0 = time.perf_counter()
    stats.reused_tokens = _shared_prefix(session, prompt)
    stats.generated = 0
    out = [pick(prefill(session, prompt, tap=tap)[None], sampler, noise, len(prompt)).item()]
    stats.t_prefill = time.perf_counter() - t0
    # Serial steps are pipelined (as mlx-lm's generate_step): the next step is built on the
    # lazy token and queued before this one is read. ``ahead`` is that step (lazy token,
    # taps, a cache mark to undo it if the token read turns out to end the run).
    ahead = None
    try:
        while True:
            # Only the last token of a batch can end the run (a round stops at its first stop
            # token); its finish reason is set before it is yielded, so a consumer can mark
            # the last token's chunk as the final one.
            for token in out[:-1]:
                stats.generated += 1
                yield token
            token = out[-1]
            stats.generated += 1
            room = max_tokens - stats.generated
            if limit is not None:
                room = min(room, limit - len(session.tokens) - 1)
            if token in stops:
                stats.finish_reason = "stop"
            elif room <= 0:
                stats.finish_reason = "length"
            yield token
            if stats.finish_reason is not None:
                return
            if ahead is None and _speculate(control, use_drafter, num_draft, room):
                out = _round(session, token, min(num_draft, room - 1), sampler, noise, stops,
                             stats, control)
            else:
                t0 = time.perf_counter() if ahead is None else t_read
                if ahead is None:
                    nxt, taps = serial_step(session, token, sampler, noise, tap)
                    mx.async_eval(nxt)
                else:
                    nxt, taps, _ = ahead
                    ahead = None
                session.feed([token], taps)
                # Build ahead only within a serial stretch: while speculating, a serial step is
                # a single cost refresh, decided after it is observed.
                if room >= 2 and not (use_drafter and control.speculating) \
                        and not _speculate(control, use_drafter, num_draft, room - 1):
                    mark = session.cache.mark()
                    ahead = (*serial_step(session, nxt, sampler, noise, tap), mark)
                    mx.async_eval(ahead[0])
                nxt = nxt.item()
                t_read = time.perf_counter()
                if ahead is not None and nxt in stops:
                    session.cache.rewind(ahead[2])   # a stop token is emitted, never fed
                    ahead = None
                stats.t_serial += t_read - t0
                stats.serial_steps += 1
                control.observe_serial(t_read - t0)
                out = [nxt]
            stats.switches = control.switches - switches_before
            stats.predicted_speedup = control.predicted_speedup()
            stats.mode = "speculative" if use_drafter and control.speculating else "serial"
    finally:
        if ahead is not None:      # closed early (a stop string): undo the step built ahead
            session.cache.rewind(ahead[2])


def _speculate(control, use_drafter: bool, num_draft: int, room: int) -> bool:
    """Whether the next step (with ``room`` tokens left to generate) is a speculative round."""
    return use_drafter and min(num_draft, room - 1) >= 1 and control.speculate_next()


def _round(session, bonus, n, sampler, noise, stops, stats, control) -> list[int]:
    """One speculative round; returns the tokens it emits (accepted drafts + next token).

    Drafts, verify and acceptance are built as one lazy graph and read back once."""
    t_start = time.perf_counter()
    caught_up = session.flush()
    if caught_up > n + 1:
        # A catch-up (the prompt, serial steps) is work per token, not per round: computed
        # before the round's clock starts, so the controller prices rounds without it.
        mx.eval(session.drafter.state())
    t0 = time.perf_counter()
    if caught_up > n + 1:
        control.observe_catchup(t0 - t_start, caught_up)
    # Bonus at position P: the drafts and the token after them sit at P+1..P+n+1.
    g = noise.at(len(session.tokens) + 1, n + 1, session.target.config.vocab_size)
    drafts, draft_logits = draft(session, bonus, n, sampler, None if g is None else g[:n])
    t1 = time.perf_counter()
    target_logits, taps = verify(session, bonus, drafts)
    a, nxt = accept(drafts, draft_logits, target_logits, sampler, g,
                    None if sampler.greedy else noise.next_key())
    read = mx.concatenate([a.reshape(1), nxt.reshape(1), drafts]).astype(mx.int32).tolist()
    a, out = read[0], read[2:2 + read[0]] + [read[1]]
    t2 = time.perf_counter()
    out = _through_stop(out, stops)
    t3 = time.perf_counter()
    commit(session, bonus, read[2:], taps, keep=len(out))
    t4 = time.perf_counter()
    _count_round(stats, control, n, a, (t_start, t0, t1, t2, t3, t4))
    return out


def _through_stop(out: list[int], stops) -> list[int]:
    """A stop token among the accepted drafts ends the run there; like serial decoding, the
    stop token is emitted but never fed to the target."""
    stop_at = next((i for i, t in enumerate(out) if t in stops), len(out) - 1)
    return out[:stop_at + 1]


def _count_round(stats: Stats, control: Controller, n: int, a: int, times):
    """Stats and controller bookkeeping of one round (``times``: its six clock readings)."""
    t_start, t0, t1, t2, t3, t4 = times
    stats.rounds += 1
    stats.drafted += n
    stats.accepted += a
    for i in range(min(a + 1, n)):
        stats.tested_by_position[i] += 1
        stats.accepted_by_position[i] += i < a
    stats.t_draft += t1 - t_start
    stats.t_verify += t2 - t1
    stats.t_rollback += t4 - t3
    stats.t_round += t4 - t_start
    control.observe_round(t4 - t0, n, num_tested=min(a + 1, n), num_accepted=a)

