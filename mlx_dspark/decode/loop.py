"""The speculative decoding loop (docs/design.md §7), one short function per step.

    prefill  -> the prompt through the target (taps queued for the drafter), first token
    per round:
      catch up the drafter gets the taps of tokens it has not seen (prompt, serial steps)
      draft    d1..dN = drafter.propose(bonus, N)             (+ the draft distributions)
      verify   target over [bonus, d1..dN] in one pass        -> p_0..p_N, taps
      accept   coupled match (same Gumbel noise) / rejection  -> a accepted, next token
      commit   target keeps bonus, d1..da (exact rollback); their taps go to the drafter

A serial step is the same machinery with no drafts. The break-even controller decides, before
each step, which of the two to run. Under a grammar (grammar.Constraint) every row of logits,
the drafter's and the target's, is masked the same way before warping: each draft is drawn under
the mask of the tokens before it, the verify pass's row i takes the mask after d1..di, and the
matcher rolls back the drafts the target rejected. ``decode(session, request)`` yields tokens
one at a time; the session holds every cache, the request every option. Stop tokens and
``max_tokens`` are applied here so that the target and drafter state after a stop is the same
as after serial decoding (the stop token is emitted, never fed)."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import mlx.core as mx

from ..request import NonFiniteLogits, Request, RequestError
from ..stats import Stats
from . import sampling
from .controller import Controller
from .grammar import Constraint
from .sampling import Noise, Sampler, constrain
from .session import Session


# ---------------------------------------------------------------------------------------------
# The steps


def _shared_prefix(session: Session, prompt: list[int]) -> int:
    """How many prompt tokens the session already holds (all of its tokens, or none)."""
    n = len(session.tokens)
    return n if n < len(prompt) and prompt[:n] == session.tokens else 0


def prefill(session: Session, prompt: list[int], tap: bool) -> mx.array:
    """Feed the prompt (or the part the session has not seen) and return the last logits.

    The prompt goes in pieces cut at the session's ``checkpoints``, and the session is handed
    to ``on_checkpoint`` after each piece but the last (a prompt cache snapshots it there).
    The cuts depend on the prompt alone, so a request continued from one of those snapshots
    computes exactly what the cold run computed after it."""
    if session.tokens and not _shared_prefix(session, prompt):
        session.reset()
    cuts = [c for c in session.checkpoints if len(session.tokens) < c < len(prompt)]
    for end in cuts + [len(prompt)]:
        new = prompt[len(session.tokens):end]
        logits, taps = session.target.step(mx.array([new]), session.cache,
                                           tap_layers=session.tap_layers if tap else None,
                                           last_only=True)
        session.feed(new, taps)
        if end < len(prompt) and session.on_checkpoint is not None:
            session.on_checkpoint(session)
    return logits[0, -1]


def pick(logits: mx.array, sampler: Sampler, noise: Noise, position: int,
         allowed: mx.array | None = None) -> mx.array:
    """Choose the token at ``position`` from one row of target logits (lazy, shape []), among
    the ``allowed`` ones under a grammar; -1 when the logits are not finite (see
    :func:`finite`)."""
    token = sampler.choose(constrain(logits, allowed), noise.at(position, 1, logits.shape[-1]))[0]
    return mx.where(mx.isfinite(logits).all(), token.astype(mx.int32), -1)


def finite(token: int, session: Session) -> int:
    """``token`` as read from the device, or the run ends here: -1 marks logits with an inf
    or a NaN (an overflowing dtype, a corrupt weight), which would otherwise come out as
    token 0 forever. The check rides in the one read each step already makes. The session's
    state is garbage from here on, so it starts over."""
    if token >= 0:
        return token
    dtype = str(getattr(session.target, "dtype", "its dtype")).rsplit(".", 1)[-1]
    position = len(session.tokens)
    session.reset()
    raise NonFiniteLogits(f"the model's logits are not finite (inf or NaN) at position "
                          f"{position}, computing in {dtype}: an activation overflowed or a "
                          f"weight is corrupt; try another dtype (--dtype, dtype=) or check "
                          f"the checkpoint (mlx-dspark verify DIR)")


def serial_step(session: Session, token, sampler: Sampler, noise: Noise, tap: bool,
                grammar: Constraint | None = None):
    """Feed one token (an int, or the previous step's lazy token), choose the next. Returns
    the lazy next token and the taps; the caller feeds the token once it has read it."""
    position = len(session.tokens) + 1
    logits, taps = session.target.step(mx.array(token, dtype=mx.int32).reshape(1, 1),
                                       session.cache,
                                       tap_layers=session.tap_layers if tap else None)
    row = logits[0, -1:]
    return pick(row, sampler, noise, position, grammar_mask(grammar, row)), taps


def grammar_mask(grammar: Constraint | None, logits: mx.array, drafts: mx.array | None = None):
    """The grammar's mask of the rows of ``logits`` (None without a grammar), computed on the
    CPU while the device computes them: the row after the emitted tokens, or with ``drafts``
    the verify pass's rows after d1..di."""
    if grammar is None:
        return None
    mx.async_eval(logits)
    return grammar.mask() if drafts is None else grammar.verify_masks(drafts)


def draft(session: Session, bonus: int, n: int, sampler: Sampler, noise: mx.array | None,
          grammar: Constraint | None = None):
    """The drafter proposes d1..dn after the bonus with ``noise`` [n, V]; lazy tokens and
    logits. Under a grammar each draft is drawn from its masked logits."""
    options = {} if grammar is None else {"constraint": grammar.drafting}
    return session.drafter.propose(bonus, n, temperature=sampler.temperature,
                                   top_p=sampler.top_p, top_k=sampler.top_k, noise=noise,
                                   cache=session.draft_cache, vocab=sampler.vocab, **options)


def verify(session: Session, bonus: int, drafts: mx.array):
    """One target pass over [bonus, d1..dn] (drafts still lazy): logits [n+1, V] and taps."""
    tokens = mx.concatenate([mx.array([bonus], dtype=mx.int32), drafts.astype(mx.int32)])
    logits, taps = session.target.verify(tokens[None], session.cache,
                                         tap_layers=session.tap_layers)
    return logits[0], taps


def accept(drafts: mx.array, draft_logits: mx.array, target_logits: mx.array,
           sampler: Sampler, noise: mx.array | None, key,
           allowed: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """How many drafts survive, and the token after them (docs/design.md §7 step 3), both lazy.

    ``noise`` is the noise the drafts were drawn with (rows 1..n) plus the row after them:
    the coupled scheme compares each draft with the target's Gumbel-max token under the same
    noise; rejection sampling compares the two warped distributions. ``allowed``: a grammar's
    masks of the target's rows (the drafter's are masked already)."""
    target_logits = constrain(target_logits, allowed)
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


def check(session: Session, request: Request):
    """What only the session can tell about a request (the request checked itself)."""
    vocab = session.target.config.vocab_size
    bad = next((t for t in request.prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError("prompt", f"token id {bad} is outside the model's vocabulary "
                                     f"[0, {vocab})")
    limit = session.target.context_limit
    if limit is not None and len(request.prompt) >= limit:
        raise RequestError("prompt", f"prompt has {len(request.prompt)} tokens; the model's "
                                     f"context limit is {limit} (max_position_embeddings), "
                                     f"leaving no room to generate")
    if request.speculative == "on" and session.drafter is None:
        raise RequestError("speculative", "speculative 'on' needs a drafter, and this "
                                          "session has none")
    if request.speculative != "off" and session.drafter is not None \
            and request.num_draft > session.drafter.max_draft:
        raise RequestError("num_draft", f"num_draft {request.num_draft}: this drafter proposes "
                                        f"at most {session.drafter.max_draft} tokens per round")


def controller(session: Session, request: Request) -> Controller:
    """The controller of this call: the session's learned one under "auto"; a forced call
    keeps its estimates to itself, so what "auto" learned stays."""
    if request.speculative != "auto":
        return Controller(request.num_draft, mode=request.speculative)
    control = session.controller
    if control is None or control.num_draft != request.num_draft:
        control = session.controller = Controller(request.num_draft)
    return control


def decode(session: Session, request: Request, stats: Stats | None = None) -> Iterator[int]:
    """The tokens of ``request`` on ``session``: up to ``max_tokens``; a stop token is
    yielded and ends the run. ``stats`` (optional) is filled in as the run goes; its
    ``finish_reason`` is set just before the last token is yielded. A request the session
    cannot serve is refused here, before any token is asked for."""
    check(session, request)
    stats = stats if stats is not None else Stats()
    grammar = None if request.grammar is None else \
        Constraint(request.grammar, request.stop_tokens, session.target.config.vocab_size)
    if session.ahead is not None:   # a generator left suspended with a step built ahead
        session.cache.rewind(session.ahead)
        session.ahead = None
    session.generation += 1
    if request.thinking is not None and request.thinking_token_budget is not None:
        return _think_within_budget(session, request, stats, grammar, session.generation)
    return _decode(session, request, stats, grammar, session.generation)


class StaleGenerator(RuntimeError):
    """A generator resumed after another call changed its session."""


def _still_current(session: Session, generation: int):
    if session.generation != generation:
        raise StaleGenerator("this generation's session was used by another call since "
                             "(a newer decode or a restore); its state is no longer this "
                             "generation's: start a new one")


def _decode(session: Session, request: Request, stats: Stats,
            grammar: Constraint | None, generation: int) -> Iterator[int]:
    prompt, max_tokens, num_draft = list(request.prompt), request.max_tokens, request.num_draft
    sampler = Sampler.of(request)
    stats.requested = request.speculative
    stats.tested_by_position = [0] * num_draft
    stats.accepted_by_position = [0] * num_draft
    stats.prompt_tokens = len(prompt)
    tap = session.drafter is not None        # a session with a drafter keeps its context whole
    use_drafter = tap and request.speculative != "off"
    stops = request.stop_tokens
    limit = session.target.context_limit
    control = controller(session, request)
    switches_before = control.switches
    noise = Noise(sampler, request.seed)
    if not sampler.greedy:
        stats.sampling, stats.seed = sampler.scheme, noise.seed

    t0 = time.perf_counter()
    stats.reused_tokens = _shared_prefix(session, prompt)
    stats.generated = 0
    last = prefill(session, prompt, tap=tap)[None]
    out = [finite(pick(last, sampler, noise, len(prompt), grammar_mask(grammar, last)).item(),
                  session)]
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
                _still_current(session, generation)
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
            if grammar is not None:
                grammar.advance(token)
            _still_current(session, generation)
            if ahead is None and _speculate(control, use_drafter, num_draft, room):
                out = _round(session, token, min(num_draft, room - 1), sampler, noise, stops,
                             stats, control, grammar)
            else:
                t0 = time.perf_counter() if ahead is None else t_read
                if ahead is None:
                    nxt, taps = serial_step(session, token, sampler, noise, tap, grammar)
                    mx.async_eval(nxt)
                else:
                    nxt, taps, _ = ahead
                    ahead = session.ahead = None
                session.feed([token], taps)
                # Build ahead only within a serial stretch: while speculating, a serial step is
                # a single cost refresh, decided after it is observed. A grammar's next mask
                # needs the token read first.
                if room >= 2 and grammar is None and not (use_drafter and control.speculating) \
                        and not _speculate(control, use_drafter, num_draft, room - 1):
                    mark = session.ahead = session.cache.mark()
                    ahead = (*serial_step(session, nxt, sampler, noise, tap), mark)
                    mx.async_eval(ahead[0])
                nxt = nxt.item()
                if nxt < 0:
                    ahead = None          # the session starts over: nothing to undo
                nxt = finite(nxt, session)
                t_read = time.perf_counter()
                if ahead is not None and nxt in stops:
                    session.cache.rewind(ahead[2])   # a stop token is emitted, never fed
                    ahead = session.ahead = None
                stats.t_serial += t_read - t0
                stats.serial_steps += 1
                control.observe_serial(t_read - t0)
                out = [nxt]
            stats.switches = control.switches - switches_before
            stats.predicted_speedup = control.predicted_speedup()
            stats.mode = "speculative" if use_drafter and control.speculating else "serial"
    finally:
        if ahead is not None and session.generation == generation:
            session.cache.rewind(ahead[2])  # closed early (a stop string): undo the step ahead
            session.ahead = None


def _speculate(control, use_drafter: bool, num_draft: int, room: int) -> bool:
    """Whether the next step (with ``room`` tokens left to generate) is a speculative round."""
    return use_drafter and min(num_draft, room - 1) >= 1 and control.speculate_next()


def _round(session, bonus, n, sampler, noise, stops, stats, control, grammar) -> list[int]:
    """One speculative round; returns the tokens it emits (accepted drafts + next token).

    Drafts, verify and acceptance are built as one lazy graph and read back once."""
    t_start = time.perf_counter()
    caught_up = session.flush()
    if caught_up > n + 1:
        # A catch-up (the prompt, serial steps) is work per token, not per round: computed
        # before the round's clock starts, so the controller prices rounds without it.
        mx.eval(session.draft_cache.arrays())
    t0 = time.perf_counter()
    if caught_up > n + 1:
        control.observe_catchup(t0 - t_start, caught_up)
    # A probe: "auto" measuring (no estimate yet, or decoding serially), not yet a decision.
    probe = control.mode == "auto" and (not control.speculating
                                        or control.predicted_speedup() is None)
    # Bonus at position P: the drafts and the token after them sit at P+1..P+n+1.
    g = noise.at(len(session.tokens) + 1, n + 1, session.target.config.vocab_size)
    drafts, draft_logits = draft(session, bonus, n, sampler, None if g is None else g[:n],
                                 grammar)
    t1 = time.perf_counter()
    target_logits, taps = verify(session, bonus, drafts)
    a, nxt = accept(drafts, draft_logits, target_logits, sampler, g,
                    None if sampler.greedy else noise.next_key(),
                    grammar_mask(grammar, target_logits, drafts))
    nxt = mx.where(mx.isfinite(target_logits).all(), nxt.astype(mx.int32), -1)  # read below
    read = mx.concatenate([a.reshape(1), nxt.reshape(1), drafts]).astype(mx.int32).tolist()
    finite(read[1], session)
    a, out = read[0], read[2:2 + read[0]] + [read[1]]
    t2 = time.perf_counter()
    out = _through_stop(out, stops)
    if grammar is not None:
        grammar.settle(len(out) - 1)   # the accepted drafts stay consumed; the rest roll back
    t3 = time.perf_counter()
    commit(session, bonus, read[2:], taps, keep=len(out))
    t4 = time.perf_counter()
    _count_round(stats, control, n, a, (t_start, t0, t1, t2, t3, t4))
    stats.probe_rounds += probe
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



# ---------------------------------------------------------------------------------------------
# A thinking budget


def _think_within_budget(session: Session, request: Request, stats: Stats,
                         grammar: Constraint | None, generation: int) -> Iterator[int]:
    """``request`` with its thinking capped at ``thinking_token_budget`` tokens.

    Three stretches on one session: the reply decoded up to the budget; then, unless the
    model closed its block itself, the ids of ``request.thinking.end`` (the template's end of
    thinking) emitted as the reply's next tokens; then the rest decoded from a prompt that
    is the request's prompt, the reply so far and those ids. That prompt extends what the
    session holds (the budget's last token and the closing ids are prefilled through the
    target, their taps queued for the drafter), so both caches hold exactly the state of
    that token sequence, as when a chat's next turn extends the session. ``stats`` shows
    the stretches as one generation (the prompt is the request's; tokens, rounds and times
    add up). A grammar's matcher follows the whole reply, the closing ids included."""
    budget, end = request.thinking_token_budget, list(request.thinking.end)
    replace = dataclasses.replace
    parts: list[Stats] = []
    reply: list[int] = []

    def show(part: Stats | None, finish: str | None):
        runs = parts + ([part] if part is not None else [])
        merged = Stats.total(runs) if runs else Stats(requested=request.speculative)
        merged.prompt_tokens = len(request.prompt)
        merged.reused_tokens = runs[0].reused_tokens if runs else 0
        merged.generated, merged.generations = len(reply), max(1, len(runs))
        merged.finish_reason = finish
        vars(stats).update(vars(merged))

    def room() -> int:
        """Tokens the reply may still take (max_tokens, and the context beyond the prompt
        the next stretch will have)."""
        left = request.max_tokens - len(reply)
        limit = session.target.context_limit
        if limit is not None:
            left = min(left, limit - len(request.prompt) - len(reply) - 1)
        return left

    if budget > 0:
        first = replace(request, max_tokens=min(budget, request.max_tokens),
                        thinking_token_budget=None)
        part = Stats()
        for token in _decode(session, first, part, grammar, generation):
            reply.append(token)
            done = part.finish_reason == "stop" or part.finish_reason is not None and room() <= 0
            show(part, part.finish_reason if done else None)
            yield token
            if done:
                return
        parts.append(part)
        if grammar is not None:
            grammar.advance(reply[-1])      # a stretch's last token is not consumed by it
    if not _contains(reply, request.thinking.close):
        for token in end:
            reply.append(token)
            show(None, "length" if room() <= 0 else None)
            yield token
            if stats.finish_reason is not None:
                return
            if grammar is not None:
                grammar.advance(token)
            _still_current(session, generation)
    # "reproducible" noise is keyed by position, so the rest keeps the seed; "rejection" draws
    # from a key stream, which the rest must not replay from its start.
    seed = request.seed
    if seed is not None and request.sampling != "reproducible":
        seed ^= 0x5DEECE66D
    rest = replace(request, prompt=request.prompt + tuple(reply), max_tokens=room(),
                   thinking_token_budget=None, seed=seed)
    part = Stats()
    for token in _decode(session, rest, part, grammar, generation):
        reply.append(token)
        show(part, part.finish_reason)
        yield token


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(tuple(seq[i:i + n]) == sub for i in range(len(seq) - n + 1))
