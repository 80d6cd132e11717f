"""The one error type that means "the user asked for something we cannot do".

Apps catch it at the top and print one line (`error: ...`) with exit code 2, instead of a
traceback: bad overrides, unsupported combinations and missing optional dependencies are
the user's to fix, not bugs.
"""

import sys


class UserError(Exception):
    """Bad input or environment; the message says what to do instead."""


def fail(message: str, code: int = 2) -> None:
    """One `error: <message>` line on stderr, then exit with `code` (2: the user's to fix)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def missing_dependency(package: str, extra: str, purpose: str) -> UserError:
    return UserError(
        f"{purpose} needs the optional package '{package}': pip install -e '.[{extra}]'"
    )


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
        done = m.group().endswith("...") and re.match(r" \([\d,]+ characters\)", message[m.end() :])
        return m.group() if done else clip(m.group(), limit)  # clipped where it was quoted

    return re.sub(r"\S{%d,}" % (limit + 1), one, message)


# an unknown-key line lists keys up to this width (with "error: "), and at least the first two
LINE_WIDTH = 100
ALL_KEYS_HINT = "all keys: --cfg job"


def _closest(key: str, every: list[str], n: int = 3) -> list[str]:
    """Known keys like `key`: a key of the same node compared by its last part (`train.stpes` is
    near `train.steps`, not `train.tp`), any other by its dotted name (`timing_warmup` finds
    `train.timing_warmup`), then by its last part alone (`model.timing_warmup` too)."""
    import difflib

    parent, _, leaf = key.rpartition(".")

    def score(known: str) -> float:
        node, _, last = known.rpartition(".")
        pair = (leaf, last) if node == parent else (key, known)
        return difflib.SequenceMatcher(None, *pair).ratio()

    ranked = sorted(every, key=score, reverse=True)  # stable: ties keep the config's order
    close = [k for k in ranked if score(k) >= 0.75][:n]
    if close:
        return close
    leaves = [k.rpartition(".")[2] for k in every]
    near = difflib.get_close_matches(leaf, leaves, n=n, cutoff=0.8)
    return [k for k, last in zip(every, leaves) if last in near][:n]


def unknown_key(key: str, names, every=(), scope: str = "the") -> str:
    """The line for an unknown config key: the closest known keys (`_closest` over the full dotted
    names `every`), else the first of `names` (the keys of its node, described by `scope`:
    "model's"); never all of them."""
    names = list(names)
    close = _closest(key, list(every) or names)
    if close:
        return f"unknown key {clip(key)}: did you mean {' or '.join(close)}? ({ALL_KEYS_HINT})"
    head = f"unknown key {clip(key)}: {scope} keys are "
    room = LINE_WIDTH - len("error: ") - len(head) - len(f", ... ({ALL_KEYS_HINT})")
    shown = names[:2]
    for name in names[2:]:
        if len(", ".join(shown + [name])) > room:
            break
        shown.append(name)
    more = ", ..." if len(shown) < len(names) else ""
    return f"{head}{', '.join(shown)}{more} ({ALL_KEYS_HINT})"
