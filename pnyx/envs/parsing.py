"""Linear-time parsing of model output: tags, integers, normalized answers.

Knows nothing about any environment. Every function here is safe on hostile text: it uses `str.find`
scans instead of backtracking regexes over the whole completion, caps what it converts, and never raises.
"""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass

# Longer than any integer a verifier should compare; Python refuses int() past 4300 digits anyway.
MAX_INT_CHARS = 40
_INT = re.compile(r"[+-]?\d{1,40}")
# A number as prose writes it: digits, optional thousands groups, an optional decimal part. No nested
# quantifiers, so a scan is linear in the text.
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
_MINUS = ("-", "\u2212")


@dataclass(frozen=True)
class Tags:
    """The `<tag>...</tag>` spans of one text, and whether the tags were balanced and non-nested."""

    contents: list[str]
    balanced: bool


def find_tags(text: str, tag: str, limit: int = 256) -> Tags:
    """All `<tag>...</tag>` contents in order (at most `limit`), by a single left-to-right scan.

    `balanced` is False when an opening tag has no closing tag, a closing tag has no opening, or a tag
    opens inside another one of the same name.
    """
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    contents: list[str] = []
    balanced = True
    pos = 0
    while len(contents) < limit:
        start = text.find(open_t, pos)
        stray_close = text.find(close_t, pos)
        if start < 0:
            if stray_close >= 0:
                balanced = False
            break
        if 0 <= stray_close < start:
            balanced = False
        end = text.find(close_t, start + len(open_t))
        if end < 0:
            balanced = False
            break
        inner = text[start + len(open_t) : end]
        if open_t in inner:
            balanced = False
        contents.append(inner)
        pos = end + len(close_t)
    return Tags(contents=contents, balanced=balanced)


def count_tag(text: str, tag: str) -> int:
    """How many `<tag>` openings the text has."""
    return text.count(f"<{tag}>")


def strip_spans(text: str, tag: str) -> str:
    """The text with every `<tag>...</tag>` span removed (an unclosed span runs to the end)."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    out: list[str] = []
    pos = 0
    while True:
        start = text.find(open_t, pos)
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find(close_t, start + len(open_t))
        if end < 0:
            break
        pos = end + len(close_t)
    return "".join(out)


def parse_int(s: str) -> int | None:
    """The integer written in `s` (whitespace and `,`/`_` thousands separators tolerated), else None.

    Refuses anything longer than `MAX_INT_CHARS` digits before converting, so `1e999999` or a
    100k-digit string costs nothing.
    """
    if len(s) > 4 * MAX_INT_CHARS:
        return None
    t = s.strip().replace(",", "").replace("_", "")
    # `−` (U+2212) is the typographic minus a model may copy from text.
    t = t.replace("\u2212", "-")
    if not _INT.fullmatch(t):
        return None
    return int(t)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalize_answer(s: str) -> str:
    """SQuAD-style normalization: NFKC, lower case, no punctuation, no articles, single spaces."""
    s = unicodedata.normalize("NFKC", s).lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def cover_em(prediction: str, golds: str | list[str]) -> bool:
    """True iff some normalized gold answer is contained (as whole words) in the normalized prediction."""
    pred = normalize_answer(prediction)
    if not pred:
        return False
    padded = f" {pred} "
    for gold in [golds] if isinstance(golds, str) else golds:
        g = normalize_answer(gold)
        if g and f" {g} " in padded:
            return True
    return False


@dataclass(frozen=True)
class Answer:
    """The answer a completion gives: the last `<answer>` content, how many there were, and whether the
    tags were well formed (every one closed, none nested, none stray)."""

    text: str | None
    count: int
    well_formed: bool

    @property
    def missing_reason(self) -> str:
        """Why `text` is None: no tag at all, or a last answer too long to parse."""
        return "answer_too_long" if self.count else "no_answer"


def last_answer(text: str, tag: str = "answer", max_len: int = 1024) -> Answer:
    """The content of the last `<tag>...</tag>` in `text`.

    An engine may or may not keep the stop string `</tag>` in the completion text, so a final `<tag>`
    left open at the very end of the text also counts as the answer (but is not well formed). Contents
    longer than `max_len` are treated as no answer: no verifier needs to parse them.
    """
    tags = find_tags(text, tag)
    contents = list(tags.contents)
    well_formed = tags.balanced
    open_t = f"<{tag}>"
    last_open = text.rfind(open_t)
    if last_open >= 0 and f"</{tag}>" not in text[last_open:]:
        contents.append(text[last_open + len(open_t) :])
        well_formed = False
    if not contents:
        return Answer(text=None, count=0, well_formed=False)
    last = contents[-1]
    if len(last) > max_len:
        return Answer(text=None, count=len(contents), well_formed=False)
    return Answer(text=last, count=len(contents), well_formed=well_formed)


def last_number(text: str) -> str | None:
    """The last number written in `text` (`-12`, `1,250`, `7.5`), as written, else None.

    A `-` right before it is its sign unless it follows a digit, letter or closing bracket (then it is the
    operator of `76-75`). A trailing sentence period is not a decimal point. Used by lenient answer
    reading when a completion has no answer tag.
    """
    last = None
    for match in _NUMBER.finditer(text):
        last = match
    if last is None:
        return None
    start, number = last.start(), last.group()
    if start > 0 and text[start - 1] in _MINUS:
        before = text[start - 2] if start > 1 else " "
        if not (before.isalnum() or before in ")]}"):
            number = "-" + number
    return number
