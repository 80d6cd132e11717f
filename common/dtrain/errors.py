"""The one error type that means "the user asked for something we cannot do".

Apps catch it at the top and print one line (`error: ...`) with exit code 2, instead of a
traceback: bad overrides, unsupported combinations and missing optional dependencies are
the user's to fix, not bugs.
"""


class UserError(Exception):
    """Bad input or environment; the message says what to do instead."""


def missing_dependency(package: str, extra: str, purpose: str) -> UserError:
    return UserError(f"{purpose} needs the optional package '{package}': pip install -e '.[{extra}]'")


# characters of a user's value an error line quotes: a 100 kB override stays one short line
VALUE_LIMIT = 200


def clip(text: str, limit: int = VALUE_LIMIT) -> str:
    """A user's value as an error line quotes it: at most `limit` characters, then `...` and its
    length."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def clip_words(message: str, limit: int = VALUE_LIMIT) -> str:
    """`message` with every run of non-blank characters longer than `limit` clipped (`clip`): for
    messages made elsewhere that quote a value whole."""
    import re

    def one(m: re.Match) -> str:
        done = m.group().endswith("...") and re.match(r" \([\d,]+ characters\)", message[m.end():])
        return m.group() if done else clip(m.group(), limit)  # clipped where it was quoted

    return re.sub(r"\S{%d,}" % (limit + 1), one, message)
