"""Lines of `dtrain plan`'s text within the terminal's width: wrapped by words, each continued
under its text."""

from __future__ import annotations

import re
import textwrap


def wrapped(head: str, text: str, width: int = 100) -> list[str]:
    """``head`` + ``text`` wrapped by words within ``width`` columns, continued under the text."""
    return textwrap.wrap(
        text,
        width,
        initial_indent=head,
        subsequent_indent=" " * len(head),
        break_long_words=False,
        break_on_hyphens=False,
    )


_HEAD = re.compile(r"^(\s*- |\s*[a-z][\w/ -]*?(?::\s+|\s{2,})|\s*)")


def fit_lines(lines: list[str], width: int = 100) -> list[str]:
    """Each line within ``width`` columns, wrapped by words under its text: a longer line's head
    (its label, "model:    ", "  step time   ", or its "  - " bullet) starts it and its
    continuation lines are indented to the text after the head."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        head = _HEAD.match(line).group(1)
        if len(head) > width // 2:
            head = head[: len(head) - len(head.lstrip())]
        out += wrapped(head, line[len(head) :], width) or [line]
    return out
