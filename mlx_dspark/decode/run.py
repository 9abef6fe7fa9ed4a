"""What the loop's steps read and count: one request decoding (:class:`Row`: its session,
constraint and processors, the stretch that decodes, what its last step emitted), the checks a
request meets before it starts, the check of each token read (:func:`finite`) and the
controller it runs under."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..models.media_rows import known
from ..request import AUTO_DRAFT, NonFiniteLogits, Request, RequestError
from ..stats import Stats
from . import costs
from ..logits.constraint import Grammatical, Unconstrained
from ..policy.controller import Controller
from ..logits.processors import BLAMED, Processors
from ..logits.sampling import Noise, Sampler, log_probs
from .session import Session


def check(session: Session, request: Request):
    """What only the session can tell about a request (the request checked itself)."""
    vocab = session.target.config.vocab_size
    bad = next((t for t in request.prompt if not known(session.target, t)), None)
    if bad is not None:
        raise RequestError("prompt", f"token id {bad} is outside the model's vocabulary "
                                     f"[0, {vocab})")
    bad = next((t for t, _ in request.logit_bias if t >= vocab), None)
    if bad is not None:
        raise RequestError("logit_bias", f"token id {bad} is outside the model's vocabulary "
                                         f"[0, {vocab})")
    bad = next((t for t in sorted(request.stop_tokens) if t >= vocab), None)
    if bad is not None:
        raise RequestError("stop_tokens", f"token id {bad} is outside the model's vocabulary "
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
            and request.num_draft != AUTO_DRAFT and request.num_draft > session.drafter.max_draft:
        raise RequestError("num_draft", f"num_draft {request.num_draft}: this drafter proposes "
                                        f"at most {session.drafter.max_draft} tokens per round")


def finite(token: int, session: Session) -> int:
    """``token`` as read from the device, or the run ends here: -1 marks logits with an inf
    or a NaN (an overflowing dtype, a corrupt weight), which would otherwise come out as
    token 0 forever; a lower code (processors.blame) a row that a request's field left
    unusable (a RequestError naming it). The check rides in the one read each step already
    makes. The session's state is garbage from here on, so it starts over."""
    if token >= 0:
        return token
    dtype = str(getattr(session.target, "dtype", "its dtype")).rsplit(".", 1)[-1]
    position, vocab = len(session.tokens), session.target.config.vocab_size
    session.reset()
    field = BLAMED[-2 - token] if token < -1 else None
    if field == "sampler":
        raise RequestError(field, f"sampler= returned a token id outside the model's "
                                  f"vocabulary [0, {vocab}) at position {position}")
    if field is not None:
        raise RequestError(field, f"{field} left the logits at position {position} with a "
                                  f"NaN, a +inf or no token above -inf: nothing can be drawn "
                                  f"from them")
    raise NonFiniteLogits(f"the model's logits are not finite (inf or NaN) at position "
                          f"{position}, computing in {dtype}: an activation overflowed or a "
                          f"weight is corrupt; try another dtype (--dtype, dtype=) or check "
                          f"the checkpoint (mlx-dspark verify DIR)")


def controller(session: Session, request: Request) -> Controller:
    """The controller of this call: the session's learned one under "auto"; a forced call
    keeps its estimates to itself, so what "auto" learned stays. With ``num_draft="auto"``
    (and a drafter that is asked) it chooses each round's length on the pair's cost curve."""
    def fresh(mode="auto"):
        if request.num_draft != AUTO_DRAFT:
            return Controller(request.num_draft, mode=mode)
        if session.drafter is None or mode == "off":
            return Controller(1, mode=mode)
        curve = costs.measured_curve(session.target, session.drafter)
        return Controller(curve.longest, mode=mode, curve=curve)

    if request.speculative != "auto":
        return fresh(request.speculative)
    control = session.controller
    auto = request.num_draft == AUTO_DRAFT
    if control is None or (control.curve is not None) != auto \
            or not auto and control.num_draft != request.num_draft:
        control = session.controller = fresh()
    return control


def read_scores(scores: list) -> list[tuple]:
    """``(token, logprob, [(id, logprob), ...])`` for each token of ``scores`` (pairs of the
    tokens and their lazy sampling.log_probs)."""
    out = []
    for tokens, (chosen, order, alts) in scores:
        for t, lp, o, a in zip(tokens, chosen.tolist(), order.tolist(), alts.tolist()):
            out.append((t, lp, list(zip(o, a))))
    return out


class StaleGenerator(RuntimeError):
    """A generator resumed after another call changed its session."""


@dataclass(eq=False)
class Row:
    """One request decoding: a row of the batch (batch.py), which ``decode`` runs as a batch
    of one. Across the whole reply it keeps its session, the constraint its output follows,
    the logits processors (the penalties count the reply from the request's own prompt on),
    the session generation it owns, its prefill's progress callback (loop.prefill) and, under
    a thinking budget, its ``plan`` (budget.Plan). A reply decodes as one stretch, or as a
    thinking budget's stretches one after another: :meth:`begin` starts each (its request,
    its stats, its sampler, noise and controller). After each step, the tokens the step
    emitted, the stats as they stood as each was handed out (a consumer that streams the row
    sees what it would see alone), the room left (None once it has ended) and why it ended
    early (``error``: the exception it raised), and the closing ids a budget ``written``
    between two steps, emitted with the next one."""

    session: Session
    constraint: Unconstrained | Grammatical
    processors: Processors
    progress: Callable[[int, int, float], None] | None = None
    generation: int = 0
    plan: object = None                 # budget.Plan
    # the stretch that decodes (None: a reply written whole before it decoded, a budget of 0
    # with no room after the closing ids)
    request: Request | None = None
    stats: Stats | None = None
    sampler: Sampler | None = None
    noise: Noise | None = None
    control: Controller | None = None
    switches_before: int = 0
    tap: bool = False          # the session has a drafter: it keeps its context whole
    use_drafter: bool = False  # ... and this request may speculate
    scores: list | None = None   # per emitted token, lazy (Request.logprobs), else None
    # the batch's controller deciding for this row (batch_control.py: its rounds' and serial
    # steps' costs are the batch's, its own controller learns acceptance alone), else None
    pooled: Controller | None = None
    batch: int = 1                # the live batch size that decided the row's latest step
    pooled_switches: int = 0      # mode switches the batch's decisions made for this stretch
    # the prompt's last tokens that belong to the reply, written, not chosen (a thinking
    # budget's closing ids): scored from the prefill's rows, with the reply's
    forced: int = 0
    tokens: list[int] = field(default_factory=list)
    seen: list[Stats] = field(default_factory=list)
    room: int | None = None
    error: Exception | None = None
    written: list[tuple[int, Stats]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.room is None

    @property
    def reply(self) -> Stats:
        """The stats of the whole reply (a thinking budget's stretches shown as one)."""
        return self.plan.stats if self.plan is not None else self.stats

    def still_current(self):
        if self.session.generation != self.generation:
            raise StaleGenerator("this generation's session was used by another call since "
                                 "(a newer decode or a restore); its state is no longer this "
                                 "generation's: start a new one")

    def before(self, *more) -> mx.array | None:
        """The tokens before a row: the session's, then ``more`` (None without processors)."""
        return self.processors.history(self.session.tokens, *more)

    def verified(self, logits: mx.array, bonus: int,
                 drafts: mx.array) -> tuple[mx.array, mx.array]:
        """The verify rows after the processors (row i after the context, bonus, d1..di) and
        each row's code (Processors.checked)."""
        ahead = mx.concatenate([mx.array([bonus], dtype=mx.int32), drafts.astype(mx.int32)]) \
            if self.processors else None
        return self.processors.checked(self.before(), logits, ahead)

    def begin(self, request: Request, stats: Stats, forced: int = 0) -> "Row":
        """Start a stretch: ``request`` decoded from its prompt, counted into ``stats``."""
        sampler = request.warping
        stats.requested = request.speculative
        control = controller(self.session, request)
        stats.tested_by_position = [0] * control.num_draft
        stats.accepted_by_position = [0] * control.num_draft
        stats.prompt_tokens = len(request.prompt)
        noise = Noise(sampler, request.seed)
        if sampler.custom is not None:
            stats.sampling = "sampler"          # the user's: it draws with its own state
        elif not sampler.greedy:
            stats.sampling, stats.seed = sampler.scheme, noise.seed
        self.request, self.stats, self.sampler, self.noise, self.control = \
            request, stats, sampler, noise, control
        self.switches_before, self.forced = control.switches, forced
        self.tap = self.session.drafter is not None
        self.use_drafter = self.tap and request.speculative != "off"
        self.scores = [] if request.logprobs is not None else None
        self.pooled, self.batch, self.pooled_switches = None, 1, 0
        if self.scores is not None:
            stats.scoring = weakref.WeakMethod(self.scored)
        return self

    def score(self, rows: mx.array, tokens):
        """Score the tokens emitted from the target's ``rows`` (the rows they were chosen
        from), when the request asks: computed beside the step, read once at the end."""
        if self.scores is not None:
            item = log_probs(rows, mx.array(tokens), self.request.logprobs)
            mx.async_eval(item)
            self.scores.append((list(tokens), item))

    def scored(self) -> list[tuple]:
        """``(token, logprob, [(id, logprob), ...])`` for every token scored so far."""
        return read_scores(self.scores)

    def count_round(self, n: int, a: int, times):
        """Stats and controller bookkeeping of one round of ``n`` drafts, ``a`` accepted
        (``times``: its six clock readings)."""
        t_start, t0, t1, t2, t3, t4 = times
        stats = self.stats
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
        if self.pooled is None:
            self.control.observe_round(t4 - t0, n, num_tested=min(a + 1, n), num_accepted=a)
        else:
            self.control.observe_accepts(min(a + 1, n), a)

    def probing(self) -> bool:
        """Whether the next round is a probe: "auto" measuring (no estimate yet, or decoding
        serially), not yet a decision."""
        control = self.control if self.pooled is None else self.pooled
        return control.mode == "auto" and (not control.speculating
                                           or control.predicted_speedup() is None)

    def note_mode(self):
        """After each step: what the controller is doing, and how often it switched."""
        control = self.control if self.pooled is None else self.pooled
        mode = "speculative" if self.use_drafter and control.speculating else "serial"
        if self.pooled is not None and self.stats.rounds + self.stats.serial_steps > 1:
            self.pooled_switches += mode != self.stats.mode
        self.stats.switches = self.control.switches - self.switches_before \
            + self.pooled_switches
        self.stats.predicted_speedup = control.decided
        self.stats.mode, self.stats.batch = mode, self.batch
