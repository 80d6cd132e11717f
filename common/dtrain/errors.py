"""The one error type that means "the user asked for something we cannot do".

Apps catch it at the top and print one line (`error: ...`) with exit code 2, instead of a
traceback: bad overrides, unsupported combinations and missing optional dependencies are
the user's to fix, not bugs.
"""


class UserError(Exception):
    """Bad input or environment; the message says what to do instead."""


def missing_dependency(package: str, extra: str, purpose: str) -> UserError:
    return UserError(f"{purpose} needs the optional package '{package}': pip install -e '.[{extra}]'")
