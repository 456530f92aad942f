"""The arithmetic of a blind A/B human review (``rlhf-review``, :mod:`tasks.cli.review`): sides, cells, the tally.

A rater compares the SFT model's and the policy's response to one prompt, shown as A and B in a random order;
the human win rate is the product's rate (:mod:`rlhf.stats`: wins / decisive, ties apart, Wilson 95%; one
rating per prompt, so the comparisons are independent).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from rlhf.stats import wilson_interval

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet would run such a cell as a formula
CHOICES = {"a": "A", "b": "B", "tie": "tie", "": None}  # a preference cell, case and whitespace ignored
METRICS = ("win_rate", "win_rate_low", "win_rate_high", "decisive", "ties", "unrated", "unusable")


def assign_sides(n: int, seed: int) -> list[str]:
    """The letter (``"A"`` or ``"B"``) that shows the policy's response in each of ``n`` rows.

    Each row is an independent fair coin of ``numpy.random.default_rng(seed)``: the same seed gives the same
    order; the SFT response takes the other letter.
    """
    import numpy as np  # noqa: PLC0415 (numpy: only this path needs it)

    return ["A" if heads else "B" for heads in np.random.default_rng(seed).random(n) < 0.5]


def parse_preference(cell: str | None) -> str | None:
    """A rater's preference cell as ``"A"``, ``"B"`` or ``"tie"``; None when blank (not rated yet).

    Case and whitespace are ignored (``" b "`` is ``"B"``, ``"TIE"`` is ``"tie"``).

    Raises:
        ValueError: anything else (the message quotes the cell).
    """
    text = "".join((cell or "").split()).lower()
    if text not in CHOICES:
        raise ValueError(f'preference "{(cell or "").strip()}" is not A, B or tie')
    return CHOICES[text]


def outcome(preference: str, policy: str) -> str:
    """``"win"`` when the rater preferred the policy's letter, ``"loss"`` for the other letter, ``"tie"`` for tie."""
    if preference == "tie":
        return "tie"
    return "win" if preference == policy else "loss"


@dataclass(frozen=True)
class Tally:
    """Counts of one review; ``decisive = wins + losses`` (ties are not in the rate)."""

    wins: int = 0
    losses: int = 0
    ties: int = 0
    unrated: int = 0
    unusable: int = 0

    @property
    def decisive(self) -> int:
        """Rows where the rater preferred one response."""
        return self.wins + self.losses

    @property
    def rate(self) -> float:
        """``wins / decisive``; NaN when no row is decisive (the rate is undefined)."""
        return self.wins / self.decisive if self.decisive else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        """Wilson 95% interval of :attr:`rate` (:func:`rlhf.stats.wilson_interval`); NaNs when undefined."""
        return wilson_interval(self.wins, self.decisive)

    def metrics(self) -> dict[str, float]:
        """The ``human/...`` metrics logged to MLflow (rates NaN when undefined, as the pipeline logs them)."""
        low, high = self.interval
        values = (self.rate, low, high, self.decisive, self.ties, self.unrated, self.unusable)
        return {f"human/{name}": float(value) for name, value in zip(METRICS, values, strict=True)}

    def line(self) -> str:
        """The result in one line; says "undefined" rather than NaN when no row is decisive."""
        rest = f"{self.ties} ties, {self.unrated} not rated, {self.unusable} unusable"
        if not self.decisive:
            return f"human win rate undefined: no decisive rows ({rest})"
        low, high = self.interval
        share = f"{self.rate:.3f} [{low:.3f}, {high:.3f}] (Wilson 95%)"
        return f"human win rate {share} over {self.decisive} decisive rows, {rest}"


def tally(outcomes: list[str | None], unusable: int = 0) -> Tally:
    """Count outcomes (``"win"``, ``"loss"``, ``"tie"``, None = not rated) into a :class:`Tally`."""
    counts = (outcomes.count(kind) for kind in ("win", "loss", "tie", None))
    return Tally(*counts, unusable=unusable)


def spreadsheet_safe(text: str) -> str:
    """``text`` with a leading ``'`` when it starts like a formula (``= + - @``, tab, CR), so a spreadsheet shows
    it as text and runs nothing (OWASP's CSV-injection rule); other text is unchanged."""
    return "'" + text if text.startswith(FORMULA_START) else text


def prompt_digest(text: str) -> str:
    """sha256 (16 hex digits) of a prompt cell as exported, whitespace runs folded (spreadsheets change line ends)."""
    if text.startswith("'") and text[1:].startswith(FORMULA_START):
        text = text[1:]
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]


def prompt_text(sample: dict[str, Any]) -> str:
    """What the rater reads as the prompt: the last user turn, or the whole conversation (``[role] text``
    blocks) when it has earlier turns."""
    messages = sample.get("messages") or []
    if len(messages) <= 1:
        return str(sample["prompt"])
    return "\n\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in messages)
