"""Hydra's and OmegaConf's errors about an override as the one `error:` line the project promises
(dtrain.run.precheck): a wrong type names the type (`train.steps='abc' must be an integer`), an
unknown key its node's keys, an unquoted non-ASCII value how to quote it. Every user value a line
quotes is clipped (dtrain.core.errors.clip)."""

from __future__ import annotations

import contextlib

from dtrain.core.errors import clip, clip_words, unknown_key


def one_line(e: BaseException) -> str:
    """Hydra's message (and its cause's first line) as one line; it quotes the override: clipped."""
    text = " ".join(str(e).split())
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0]
        if first not in text:
            text += f" ({first})"
    return clip_words(text)


_WORDS = {
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "String": "a string",
}


def typed_message(e: BaseException) -> str | None:
    """OmegaConf's type error for `train.steps=abc` as `train.steps='abc' must be an integer`, and
    its unknown key `model.n_laye=4` as `unknown key model.n_laye: model's keys are ...`."""
    import dataclasses
    import re
    import typing

    from omegaconf.errors import ConfigAttributeError, ValidationError

    cause = e if isinstance(e, (ValidationError, ConfigAttributeError)) else e.__cause__
    if isinstance(cause, ConfigAttributeError) and dataclasses.is_dataclass(
        getattr(cause, "object_type", None)
    ):
        key = str(cause.full_key)
        parent = key.rsplit(".", 1)[0] + "'s" if "." in key else "the top-level"
        known = [f.name for f in dataclasses.fields(cause.object_type)]
        return unknown_key(key, known, _dotted_keys(cause.parent_node), parent)
    match = re.search(r"could not be converted to (\w+)", str(getattr(cause, "msg", "")))
    if not isinstance(cause, ValidationError) or not match or match.group(1) not in _WORDS:
        return None
    key = str(cause.full_key)
    with contextlib.suppress(Exception):  # an Optional field also takes null
        hint = typing.get_type_hints(cause.object_type)[key.rsplit(".", 1)[-1]]
        if type(None) in typing.get_args(hint):
            return f"{key}={clip(repr(cause.value))} must be {_WORDS[match.group(1)]} or null"
    return f"{key}={clip(repr(cause.value))} must be {_WORDS[match.group(1)]}"


def _dotted_keys(node) -> list[str]:
    """Every key of the config `node` belongs to, dotted (`train.timing_warmup`), Hydra's own left
    out: what a did-you-mean picks from."""
    from omegaconf import DictConfig

    def walk(n, prefix: str):
        for k in n.keys():
            child = n._get_node(k)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                yield from walk(child, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    if node is None:
        return []
    root = node._get_root()
    return [k for k in walk(root, "") if not k.startswith("hydra")]


def quote_hint(e: BaseException, overrides: list[str]) -> str:
    """Hydra's grammar takes non-ASCII characters (`results_dir=résultats`) only in a quoted
    value."""
    if "token recognition error" in one_line(e) and not "".join(overrides).isascii():
        return ": quote a value with non-ASCII characters, e.g. 'results_dir=\"résultats\"'"
    return ""
