"""Checking a math answer against a gold answer: an exact numeric fast path, then `math-verify`.

Knows nothing about environments or tasks. Invariant: bounded time on any input. Plain numbers and
fractions are compared exactly without sympy; anything else is screened first (length, digit runs,
big exponents and factorials are refused, since sympy would try to expand them) and then handed to
math-verify, whose own signal-based timeout applies in the main thread. Off the main thread its
timeout cannot run (SIGALRM), so the screen is what bounds the time there.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Literal, cast

MAX_ANSWER_CHARS = 200
MATH_VERIFY_TIMEOUT_S = 2

_NUMBER = re.compile(r"[+-]?(\d{1,30}(\.\d{0,20})?|\.\d{1,20})")
_FRACTION = re.compile(r"[+-]?\d{1,30}/\d{1,30}")
_NUMBER_THEN_WORDS = re.compile(r"([+-]?[\d.,/]{1,40})\s+[A-Za-z][A-Za-z ]{0,40}")
_HAZARDS = [
    re.compile(r"\d{31}"),  # absurd digit runs
    re.compile(r"(\^|\*\*)\s*[{(]?\s*[+-]?\s*\d{3}"),  # x^123 and up: sympy expands powers
    re.compile(r"(\^|\*\*)[^\^*]{0,12}(\^|\*\*)"),  # towers a^b^c
    re.compile(r"\d{3}\s*!"),  # 123! and up
    re.compile(r"\d[eE][+-]?\d{3}"),  # 1e999999
]

Verdict = Literal["equal", "different", "refused"]


def clean_number_text(s: str) -> str:
    """Drop what surrounds a number in prose: `$`, `\\$`, thousands commas, a trailing period, spaces."""
    s = s.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("\u2212", "-")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    s = s.rstrip(".").strip()
    if s.endswith("%"):
        s = s[:-1].strip()
    return s


def as_fraction(s: str) -> Fraction | None:
    """The exact value of a plain number or `a/b` fraction string, else None (never raises)."""
    t = clean_number_text(s)
    if _NUMBER.fullmatch(t):
        return Fraction(t)
    if _FRACTION.fullmatch(t):
        num, den = t.split("/")
        return Fraction(int(num), int(den)) if int(den) != 0 else None
    return None


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K solution (`... #### 42`), or the whole string if there is no `####`."""
    text = str(answer)
    return clean_number_text(text.rsplit("####", 1)[1] if "####" in text else text)


def math_equal(gold: str, prediction: str) -> Verdict:
    """Whether `prediction` equals `gold` mathematically: "equal", "different", or "refused" (too
    long or hazardous to evaluate)."""
    if len(prediction) > MAX_ANSWER_CHARS:
        return "refused"
    g, p = as_fraction(gold), as_fraction(prediction)
    if p is None and (m := _NUMBER_THEN_WORDS.fullmatch(clean_number_text(prediction))):
        p = as_fraction(m.group(1))  # "43 dollars", "12 apples"
    if g is not None and p is not None:
        return "equal" if g == p else "different"
    if any(h.search(prediction) for h in _HAZARDS):
        return "refused"
    from math_verify import parse, verify  # imported here: sympy is slow to import

    # math_verify's timeout uses signals (main thread only); None turns it off (its annotation says int)
    timeout = cast(
        int, MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    )
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = parse(f"${prediction}$", parsing_timeout=timeout)
    if not pred_parsed:
        pred_parsed = parse(prediction, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return "different"
    return "equal" if verify(gold_parsed, pred_parsed, timeout_seconds=timeout) else "different"
