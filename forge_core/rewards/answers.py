"""Pulling the final answer out of a completion: tagged answers and GSM8K-style final numbers.

    tagged_answer("so <answer> 0168 </answer>")        # "0168"
    final_number("... 3 + 4 = 7. #### 7")               # 7.0
    parse_number("$1,234.50")                            # 1234.5

Standard library only: reward functions run inside the rollout stage for every sample.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

DEFAULT_TAG = "answer"
# GSM8K's reference answers end with "#### <number>"; models trained on it often copy the marker.
GSM8K_MARKER = "####"

# An optionally signed number with thousands separators, decimals or a simple fraction ("3/4").
_NUMBER = r"[-+]?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\$?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_MARKER_RE = re.compile(re.escape(GSM8K_MARKER) + r"\s*(" + _NUMBER + ")")


@functools.lru_cache(maxsize=64)
def _tag_regex(tag: str) -> re.Pattern[str]:
    if not re.fullmatch(r"[A-Za-z_][\w\-]*", tag):
        raise ValueError(f"tag={tag!r}: use a plain tag name such as 'answer' (letters, digits, '_' or '-')")
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def tagged_answer(text: str, tag: str = DEFAULT_TAG) -> str | None:
    """The stripped content of the first `<tag>...</tag>` in `text`; None when no closed tag exists."""
    match = _tag_regex(tag).search(text)
    return match.group(1).strip() if match else None


def tag_counts(text: str, tag: str = DEFAULT_TAG) -> tuple[int, int]:
    """How many opening and closing `tag` markers `text` contains."""
    _tag_regex(tag)  # validates the name
    return text.count(f"<{tag}>"), text.count(f"</{tag}>")


def parse_number(text: str) -> float | None:
    """A number written the usual ways (`-3`, `1,234`, `$5.50`, `3/4`, `.5`) as a float; None otherwise."""
    cleaned = text.strip().replace("$", "").replace(",", "").replace(" ", "")
    if not cleaned:
        return None
    try:
        return float(Fraction(cleaned)) if "/" in cleaned else float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _last_number(text: str) -> float | None:
    for candidate in reversed(_NUMBER_RE.findall(text)):
        value = parse_number(candidate)
        if value is not None:
            return value
    return None


def final_number(text: str, tag: str = DEFAULT_TAG) -> float | None:
    """The final numeric answer of a GSM8K-style completion or reference answer.

    Looked up in this order: the last number inside the answer tag, the number after a `####` marker, the last
    number anywhere in the text. None when there is no number at all.
    """
    tagged = tagged_answer(text, tag)
    if tagged is not None:
        return _last_number(tagged)
    marked = _MARKER_RE.findall(text)
    if marked:
        return parse_number(marked[-1])
    return _last_number(text)
