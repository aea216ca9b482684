"""Final-answer parsing shared by data prep and rewards (standard library only, safe to import anywhere).

    parse_gsm8k_answer("48 + 24 = 72 clips.\\n#### 72")  # "72"
"""

from __future__ import annotations

import re

GSM8K_SEPARATOR = "####"
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def parse_gsm8k_answer(answer: str) -> str | None:
    """The final number after the last `####` (thousands commas removed), or None if there is none."""
    if GSM8K_SEPARATOR not in answer:
        return None
    final = answer.rsplit(GSM8K_SEPARATOR, 1)[1].strip().replace(",", "")
    return final if _NUMBER_RE.fullmatch(final) else None
