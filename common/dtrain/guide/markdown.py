"""Free text into a Markdown table cell: a `|` escaped, a newline made a space."""

from __future__ import annotations


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
