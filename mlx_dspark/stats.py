"""What a generation did, typed, and the one way it is printed (free of MLX).

``decode`` (decode/loop.py) fills a :class:`Stats` as it goes; every streamed chunk carries a copy
(:meth:`Stats.snapshot`), the last one with the peak memory read once at the end. Consumers
read its fields and properties; :meth:`Stats.as_dict` is for JSON (the server's ``dspark``
field). For code written against the earlier dict, ``stats["name"]`` reads
the same keys as ``as_dict()``.

``accepted`` counts accepted drafts only; ``mean_accepted_per_round`` is accepted drafts per
round (bonus excluded) and ``mean_tokens_per_round`` the tokens each round emitted (bonus
included, = mean_accepted + 1 before any stop). A round is one lazy graph read once:
``t_draft`` is the drafter's catch-up and building the drafts' graph, ``t_verify`` building
the verify and waiting for the read (the drafter's and the target's compute), ``t_rollback``
queuing the commit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(eq=False)
class Stats(Mapping):
    """Counters (token counts exclude the prompt) and wall times in seconds of one
    generation."""

    requested: str = "auto"       # the request's speculative mode
    mode: str = "serial"          # what the controller was doing at the end
    finish_reason: str | None = None
    finish_detail: str | None = None  # what ended a "length" run: "max_tokens" or "context"
    prompt_tokens: int = 0
    reused_tokens: int = 0        # prompt tokens a session already held (not prefilled again)
    generated: int = 0
    rounds: int = 0
    probe_rounds: int = 0         # rounds "auto" ran to measure (in rounds), not to speculate
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
    predicted_speedup: float | None = None
    batch: int = 1                # the live batch size the mode was last decided at (1: alone)
    peak_memory_gb: float | None = None     # MLX's allocator, 10^9 bytes (set at the end)
    peak_rss_gb: float | None = None        # the process's peak resident set (set at the end)
    generations: int = 1          # how many generations these counts sum (Stats.total)
    sampling: str | None = None   # the scheme of a sampled run ("sampler": a user's; None: greedy)
    seed: int | None = None       # the seed a sampled run used, given or drawn
    # (token, logprob, [(id, logprob), ...]) per emitted token when the request asks
    # (Request.logprobs), set with the last token; shared by the snapshots, not printed
    logprobs: list | None = field(default=None, repr=False)
    # while such a generation runs, a weak reference to what reads its scores so far (a stop
    # string may end the reply before the generation names its finish); not printed
    scoring: object = field(default=None, repr=False, compare=False)

    def scores(self) -> list | None:
        """The logprobs: the generation's, or those read so far while it runs (None: none
        are scored)."""
        if self.logprobs is not None:
            return self.logprobs
        read = self.scoring() if self.scoring is not None else None
        return None if read is None else read()

    def snapshot(self) -> "Stats":
        """A copy that later tokens do not change (taken per token: a plain field copy, a
        third of ``copy.copy``'s time)."""
        snap = object.__new__(Stats)
        snap.__dict__.update(self.__dict__)
        snap.tested_by_position = list(self.tested_by_position)
        snap.accepted_by_position = list(self.accepted_by_position)
        return snap

    # -- derived ----------------------------------------------------------------------------

    @property
    def generated_tokens(self) -> int:
        return self.generated

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position, the share of the rounds that tested it that accepted it."""
        return [a / t if t else None
                for a, t in zip(self.accepted_by_position, self.tested_by_position)]

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        round_tokens = self.generated - self.serial_steps - min(self.generated, self.generations)
        return round_tokens / self.rounds if self.rounds else 0.0

    @property
    def decode_time(self) -> float:
        return self.t_serial + self.t_round

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: a generation's first token comes from its prefill, so it counts the
        rest."""
        t, decoded = self.decode_time, self.generated - self.generations
        return decoded / t if t > 0 and decoded > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.t_prefill if self.t_prefill else 0.0

    @classmethod
    def total(cls, runs: list["Stats"]) -> "Stats":
        """Several generations as one (a chat's turns): counts and times add up; the mode,
        finish reason and memory are the last run's."""
        out = runs[-1].snapshot()
        n = max(len(s.tested_by_position) for s in runs)
        for name in ("prompt_tokens", "reused_tokens", "generated", "rounds", "probe_rounds",
                     "serial_steps",
                     "drafted", "accepted", "switches", "generations", "t_prefill", "t_serial", "t_draft",
                     "t_verify", "t_rollback", "t_round"):
            setattr(out, name, sum(getattr(s, name) for s in runs))
        for name in ("tested_by_position", "accepted_by_position"):
            setattr(out, name, [sum(getattr(s, name)[i] for s in runs
                                    if i < len(getattr(s, name))) for i in range(n)])
        return out

    # -- JSON and the mapping view ---------------------------------------------------------

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "requested": self.requested,
            "finish_reason": self.finish_reason,
            "finish_detail": self.finish_detail,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "generated_tokens": self.generated,
            "rounds": self.rounds,
            "probe_rounds": self.probe_rounds,
            "serial_steps": self.serial_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_by_position": self.acceptance_by_position,
            "tested_by_position": list(self.tested_by_position),
            "accepted_by_position": list(self.accepted_by_position),
            "mean_accepted_per_round": self.mean_accepted_per_round,
            "mean_tokens_per_round": self.mean_tokens_per_round,
            "mode_switches": self.switches,
            "predicted_speedup": self.predicted_speedup,
            "batch": self.batch,
            "sampling": self.sampling,
            "seed": self.seed,
            "time": {
                "prefill": self.t_prefill,
                "serial": self.t_serial,
                "draft": self.t_draft,
                "verify": self.t_verify,
                "rollback": self.t_rollback,
                "other": self.t_round - self.t_draft - self.t_verify - self.t_rollback,
            },
            "tokens_per_s": self.tokens_per_s,
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "peak_memory_gb": self.peak_memory_gb,
            "peak_rss_gb": self.peak_rss_gb,
        }

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


# ---------------------------------------------------------------------------------------------
# Printing


def format_positions(shares) -> str:
    """Acceptance by draft position as ``0.61 0.70 -`` (``-``: never tested)."""
    return " ".join("-" if a is None else f"{a:.2f}" for a in shares)


def format_acceptance(stats: Stats) -> str:
    return format_positions(stats.acceptance_by_position)


def format_mode(stats: Stats) -> str:
    """The mode, and under "auto" why: the controller's predicted speedup (tokens per unit
    of time, speculative over serial; in a batch the batch's, at its live size) against
    break-even, 1.00."""
    line = f"{stats.mode} (requested {stats.requested}, {stats.switches} switches)"
    p = stats.predicted_speedup
    if stats.requested != "auto" or p is None:
        return line
    at = f" at batch {stats.batch}" if stats.batch > 1 else ""
    why = f"{line}: speculation predicted at {p:.2f}x serial speed{at}, break-even 1.00"
    return f"{why}, so serial" if stats.mode == "serial" else why


def format_rounds(stats: Stats) -> str:
    rounds = f"{stats.rounds - stats.probe_rounds} speculative"
    if stats.probe_rounds:
        rounds += f" + {stats.probe_rounds} probe{'s' if stats.probe_rounds != 1 else ''}"
    return f"{rounds}, {stats.serial_steps} serial"


def format_stats(stats: Stats) -> list[str]:
    """The summary of ``generate --stats`` and ``chat``'s /stats: one ``name: value`` line
    each. When every round was a probe, the acceptance is labelled as the probes'."""
    of = ""
    if stats.rounds and stats.probe_rounds == stats.rounds:
        of = f" (probe round{'s' if stats.rounds != 1 else ''} only)"
    lines = [
        f"mode: {format_mode(stats)}",
        f"prompt: {stats.prompt_tokens} tokens, {stats.prefilled_tokens} prefilled, "
        f"{stats.prompt_tokens_per_s:.1f} tokens/s",
        f"generation: {stats.generated} tokens, {stats.tokens_per_s:.1f} tokens/s",
        f"rounds: {format_rounds(stats)}",
        f"mean accepted per round: {stats.mean_accepted_per_round:.2f}{of}",
        f"acceptance by position: {format_acceptance(stats)}{of}",
        f"finish: {format_finish(stats)}",
    ]
    if stats.sampling is not None:
        seed = "" if stats.seed is None else f", seed {stats.seed}"    # a user's sampler: none
        lines.insert(1, f"sampling: {stats.sampling}{seed}")
    if stats.peak_memory_gb is not None:
        lines.append(f"peak memory: {stats.peak_memory_gb:.3f} GB (MLX), process peak RSS "
                     f"{stats.peak_rss_gb:.3f} GB")
    return lines


def format_finish(stats: Stats) -> str:
    """The finish reason, "context" for a run the model's context limit ended (a "length"
    run whose ``max_tokens`` had room left)."""
    return "context" if stats.finish_detail == "context" else str(stats.finish_reason)


def format_line(stats: Stats) -> str:
    """The same facts on one line (the chat's status after each answer)."""
    return (f"[{stats.generated} tokens, {stats.tokens_per_s:.1f} tokens/s, "
            f"accepted {stats.mean_accepted_per_round:.2f}/round "
            f"({format_acceptance(stats)}), prompt {stats.prompt_tokens} tokens: "
            f"{stats.prefilled_tokens} prefilled, {stats.reused_tokens} reused, {stats.mode}, "
            f"{format_finish(stats)}]")


def format_progress(done: int, total: int, reused: int, seconds: float) -> str:
    """A prefill's progress as ``generate``, ``chat`` and the server's log show it: the prompt
    tokens in the cache of the prompt's, the rate of those prefilled (``reused`` ones were
    already held) and the time left at that rate, or the time it took once done."""
    rate = (done - reused) / seconds if seconds > 0 else 0.0
    line = f"prefill {done}/{total} tokens, {rate:.0f} tokens/s"
    if done >= total:
        return f"{line}, {seconds:.1f} s"
    return f"{line}, about {(total - done) / rate:.0f} s left" if rate > 0 else line
