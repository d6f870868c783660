"""The accounting of ``omnirelay verify chaos`` (pure): which requests overlapped which fault, and
for each fault and in total how many were sent, completed, failed (by error code, and without
one), hung, came back with tokens or audio missing or repeated, and the longest pause a client
saw. Tested in ``tests/unit/test_chaos_soak.py``.

Clocks: every time here is a ``time.monotonic()`` reading of the soak's process, seconds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from benchmarks.chat_streams import Seen


@dataclass(frozen=True)
class Ask:
    """What one request asks for."""

    prompt: str
    max_tokens: int
    audio: bool
    stream: bool

    @property
    def key(self) -> tuple[str, int, bool]:
        """The key of its fault-free reference: (prompt, max_tokens, audio)."""
        return (self.prompt, self.max_tokens, self.audio)


@dataclass(frozen=True)
class Record:
    """One request of the soak: what it asked and what its client saw."""

    ask: Ask
    seen: Seen


@dataclass(frozen=True)
class Strike:
    """One fault the soak injected."""

    name: str
    """The fault, with its victim (``kill -9 a thinker replica [thinker-1]``)."""
    at_s: float
    """When it was injected."""
    until_s: float | None
    """When it was over: the victim's replacement registered, the stopped process continued and
    live again, the server back; None: not by the end of the soak."""
    verified: str
    took: bool
    """The injection was verified (:class:`tests.verification.fault_injection.Injection`)."""
    during: str = ""
    """The earlier faults not yet over when it was injected (their victims, comma-separated)."""


@dataclass(frozen=True)
class Tally:
    """What happened to a set of requests."""

    sent: int
    completed: int
    """Ended without an error (right or wrong)."""
    failed: dict[str, int]
    """Failures with an OpenAI error code, by code."""
    no_code: int
    """Failures without an error code (by what the client raised, in :attr:`no_code_kinds`)."""
    hung: int
    """Not ended ``hung_after_s`` after they were sent."""
    tokens_wrong: int
    """Completed, and their token ids or text differ from the fault-free reference, or their
    token count (streamed or in ``usage``) is not ``max_tokens``: tokens missing or repeated."""
    audio_wrong: int
    """Completed audio requests whose audio length (bytes) differs from the reference's, or,
    streamed, whose number of audio chunks does."""
    pause_s: float
    """The longest silence of a request after its first token or audio chunk, until its next one
    or its end, seconds."""
    no_code_kinds: dict[str, int]


@dataclass(frozen=True)
class Account:
    """Rows (one per fault, in order), the requests that overlapped no fault, and the total."""

    rows: list[tuple[Strike, Tally]]
    quiet: Tally
    total: Tally


def tokens_wrong(seen: Seen, ask: Ask, ref: Seen) -> bool:
    """True when a completed request's tokens are not the reference's (missing, repeated or other)."""
    count_off = len(seen.token_ids) != ask.max_tokens or seen.usage_tokens != ask.max_tokens
    return count_off or seen.token_ids != ref.token_ids or seen.text != ref.text


def audio_wrong(seen: Seen, ask: Ask, ref: Seen) -> bool:
    """True when a completed audio request's audio is not as long as the reference's (or,
    streamed, does not come in as many chunks)."""
    if not ask.audio:
        return False
    return seen.audio_bytes != ref.audio_bytes or (ask.stream and seen.audio_chunks != ref.audio_chunks)


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where ``got`` and ``want`` differ, a missing tail included; None: equal."""
    if got == want:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )


def seam(got: list[int], want: list[int], at: int, window: int = 8) -> str:
    """What happened at position ``at``, where ``got`` leaves ``want``: ``"missing N"`` (``got``
    goes on with ``want`` N tokens later), ``"repeated N"`` (``got`` goes on with what ``want`` had
    N tokens earlier), or ``"other tokens"`` (neither, for the next ``window`` tokens: the request
    produced a different continuation)."""
    for n in range(1, window + 1):
        if got[at : at + window] == want[at + n : at + n + window] and at + n + window <= len(want):
            return f"missing {n}"
        if at >= n and got[at : at + window] == want[at - n : at - n + window] and at + window <= len(got):
            return f"repeated {n}"
    return "other tokens"


def explain(r: Record, ref: Seen) -> str | None:
    """One line on what is wrong with a request (None: it completed right): its id and ask, then
    the error, the hang, or where its tokens or audio leave the reference's."""
    s, a = r.seen, r.ask
    head = f"{s.id or '(no id)'} ({a.max_tokens} tokens, {'audio' if a.audio else 'text'}, {'streamed' if a.stream else 'whole'})"
    if s.ended_s is None:
        return f"{head}: hung, {len(s.token_ids)} tokens received"
    if s.error is not None:
        status = f" {s.status}" if s.status is not None else ""
        return f"{head}: failed{status} {s.error_code or s.error} after {len(s.token_ids)} tokens"
    problems = []
    if tokens_wrong(s, a, ref):
        at = first_difference(s.token_ids, ref.token_ids)
        where = (
            "ids equal"
            if at is None
            else f"ids leave the reference at {at} ({seam(s.token_ids, ref.token_ids, at)})"
        )
        problems.append(
            f"{len(s.token_ids)} token ids (usage {s.usage_tokens}), {where}, text {'equal' if s.text == ref.text else 'differs'}"
        )
    if audio_wrong(s, a, ref):
        problems.append(
            f"audio {s.audio_bytes} bytes in {s.audio_chunks} chunks, reference {ref.audio_bytes} in {ref.audio_chunks}"
        )
    return f"{head}: {'; '.join(problems)}" if problems else None


def _span(r: Record, hung_after_s: float) -> tuple[float, float]:
    """When the request was in flight: sent until ended (a hung one: until it counted as hung)."""
    sent = r.seen.sent_s if r.seen.sent_s is not None else 0.0
    return sent, r.seen.ended_s if r.seen.ended_s is not None else sent + hung_after_s


def _gaps(seen: Seen) -> list[tuple[float, float]]:
    """The silences of a request after its first arrival: between arrivals, and to its end."""
    times = [*seen.at, *([seen.ended_s] if seen.ended_s is not None and seen.at else [])]
    return list(itertools.pairwise(times))


def tally(
    records: list[Record],
    references: dict[tuple[str, int, bool], Seen],
    window: tuple[float, float] = (-math.inf, math.inf),
) -> Tally:
    """The tally of ``records``; the pause is the longest that overlaps ``window`` (start, end)."""
    failed: dict[str, int] = {}
    kinds: dict[str, int] = {}
    completed = hung = tokens = audio = 0
    pause = 0.0
    for r in records:
        s = r.seen
        gaps = [b - a for a, b in _gaps(s) if a <= window[1] and b >= window[0]]
        pause = max(pause, *gaps) if gaps else pause
        if s.ended_s is None:
            hung += 1
        elif s.error is not None and s.error_code is not None:
            failed[s.error_code] = failed.get(s.error_code, 0) + 1
        elif s.error is not None:
            kinds[s.error] = kinds.get(s.error, 0) + 1
        else:
            completed += 1
            ref = references[r.ask.key]
            tokens += tokens_wrong(s, r.ask, ref)
            audio += audio_wrong(s, r.ask, ref)
    return Tally(len(records), completed, failed, sum(kinds.values()), hung, tokens, audio, pause, kinds)


def account(
    strikes: list[Strike],
    records: list[Record],
    references: dict[tuple[str, int, bool], Seen],
    hung_after_s: float,
    end_s: float,
) -> Account:
    """Attribute each request to every fault it overlapped in time: it was in flight (sent until
    ended, or until ``hung_after_s`` after it was sent for one that hung) at some moment between
    the fault's injection and its end (``until_s``; ``end_s``, the end of the soak, for a fault
    not over by then). A request may overlap several faults and then counts in each of their
    rows, once in the total."""
    rows = []
    overlapped: set[int] = set()
    for strike in strikes:
        window = (strike.at_s, strike.until_s if strike.until_s is not None else end_s)
        mine = []
        for i, r in enumerate(records):
            sent, ended = _span(r, hung_after_s)
            if sent <= window[1] and ended >= window[0]:
                mine.append(r)
                overlapped.add(i)
        rows.append((strike, tally(mine, references, window)))
    quiet = [r for i, r in enumerate(records) if i not in overlapped]
    return Account(rows, tally(quiet, references), tally(records, references))


def lost_or_hung(acc: Account) -> bool:
    """The soak's verdict: True when a request hung or came back with tokens or audio missing or
    repeated (the exit status is then 1)."""
    t = acc.total
    return t.hung > 0 or t.tokens_wrong > 0 or t.audio_wrong > 0


HEAD = (
    "t s",
    "fault",
    "verified",
    "during",
    "over s",
    "sent",
    "completed",
    "failed (code)",
    "failed, no code",
    "hung",
    "tokens wrong",
    "audio wrong",
    "longest pause s",
)


def _cells(t: Tally) -> list[str]:
    failed = ", ".join(f"{n} {c}" for c, n in sorted(t.failed.items())) or "0"
    no_code = ", ".join(f"{n} {k}" for k, n in sorted(t.no_code_kinds.items())) or "0"
    return [str(t.sent), str(t.completed), failed, no_code, str(t.hung), str(t.tokens_wrong)]


def render(acc: Account, t0_s: float) -> str:
    """The table (Markdown): a row per fault (``t s``: seconds from the load's start ``t0_s`` to
    the injection; ``over s``: from the injection to its end), the requests that overlapped no
    fault, the total."""
    lines = [" | ".join(HEAD), " | ".join("---" for _ in HEAD)]

    def add(first: list[str], t: Tally) -> None:
        lines.append(" | ".join([*first, *_cells(t), str(t.audio_wrong), f"{t.pause_s:.2f}"]))

    for s, t in acc.rows:
        over = "not over" if s.until_s is None else f"{s.until_s - s.at_s:.1f}"
        verified = s.verified if s.took else f"NOT VERIFIED: {s.verified}"
        add([f"{s.at_s - t0_s:.0f}", s.name, verified, s.during or "-", over], t)
    add(["-", "(no fault)", "-", "-", "-"], acc.quiet)
    add(["-", f"total ({len(acc.rows)} faults)", "-", "-", "-"], acc.total)
    return "\n".join(f"| {line} |" for line in lines)
