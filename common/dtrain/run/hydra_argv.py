"""The command line as Hydra reads it, for the checks that run before Hydra starts
(dtrain.run.precheck): which arguments are overrides, whether Hydra will run the app at all, one
key's plain value, and Hydra's own override parser."""

from __future__ import annotations

# command-line flags after which Hydra does not run the app (help, config printing, completion)
NO_RUN = (
    "-h",
    "--help",
    "--hydra-help",
    "-c",
    "--cfg",
    "-i",
    "--info",
    "--shell-completion",
    "-sc",
    "--resolve",
    "-p",
    "--package",
    "--experimental-rerun",
)
_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def split_argv(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun, checkable) from a Hydra command line. Not checkable: Hydra will not run
    the app (--help, --cfg, ...) or composes another config (--config-name/-path/-dir); Hydra
    handles those as usual."""
    overrides, multirun, checkable, skip = [], False, True, False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if arg in ("-m", "--multirun"):
            multirun = True
        elif flag in NO_RUN or flag in _WITH_VALUE:
            checkable = False
            skip = arg in _WITH_VALUE  # its value is the next argument
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun, checkable


def literal_override(argv: list[str], key: str) -> str | None:
    """The value of `key=...` on the command line when it is one plain value (no sweep, no
    interpolation)."""
    value = None
    for arg in split_argv(argv)[0]:
        k, eq, v = arg.lstrip("+").partition("=")
        if eq and k == key:
            value = v
    if value is None or any(c in value for c in ",$()[]"):
        return None
    return value.strip("'\"")


def parse_overrides(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides=overrides)


def override_key(override) -> str:
    """The key an override sets, whatever its form (`+k`, `++k`, `~k`, `group@package`)."""
    return override.key_or_group + (f"@{override.package}" if override.package else "")
