"""The README's commands work as written, top to bottom, in a new shell.

The commands are read from the README's ```bash blocks, so these tests follow the README. A new
shell has no virtual environment on its PATH: each command runs under `env -i` with the system PATH,
after the README's own `source`/`eval` lines that come before it (its "shell state").

* fast: every command resolves the way the README says: `make` targets exist, `python -m X`
  modules have an entry point and their overrides pass the checks the app runs before Hydra starts
  (keys, types, every sweep point), `dtrain` arguments parse, scripts exist; and the README's
  activation line puts .venv's python, dtrain and torchrun first on a bare PATH.
* slow: the local commands run, at small sizes (SMALL is appended to them), in a scratch folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

README = REPO / "README.md"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# overrides that make a README command small (appended; README sizes are already small on CPU)
SMALL = {
    "fsdp_scaling": ["train.steps=4", "train.timing_warmup=1"],
    "tp_attention": ["iters=2", "timing_warmup=1"],
    "scripts/bench-costmodel": ["--repeat", "1", "--out", "results/bench-costmodel"],
}  # into the scratch folder


def commands(text: str | None = None) -> list[str]:
    """The commands of every ```bash block, in order: comments dropped, `\\` continuations
    joined."""
    text = README.read_text() if text is None else text
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            cmd = line.split(" # ")[0].split("\t#")[0].strip()
            if cmd and not cmd.startswith("#"):
                out.append(re.sub(r"\s+", " ", cmd))
    return out


def is_state(cmd: str) -> bool:
    """Lines that set up the shell for the ones after them."""
    return cmd.split()[0] in ("source", ".", "eval", "export", "cd")


def not_local(cmd: str) -> str | None:
    """Why a command is not run by the slow test (None: it is)."""
    if "slurm" in cmd:
        return "needs a Slurm cluster (tests/test_slurm*.py run them on the local one)"
    if cmd.startswith("make "):
        return "make targets: the capstone has its own slow test; make test is CI itself"
    if "<" in cmd:
        return "a placeholder for an earlier run's output"
    if "results/capstone" in cmd:
        return (
            "reads make capstone's runs (the capstone's own slow test builds the guide from them)"
        )
    return None


def module_and_args(cmd: str) -> tuple[str, list[str]] | None:
    words = shlex.split(cmd)
    if words[0] in ("python", "python3") and words[1] == "-m" or words[0] == "torchrun":
        i = words.index("-m")
        return words[i + 1], words[i + 2 :]
    return None


def test_readme_has_the_commands_it_promises():
    cmds = commands()
    assert cmds[:2] == ["make capstone", "make test"]
    assert any(c.startswith("python -m tp_attention") for c in cmds) and any(
        c.startswith("dtrain plan") for c in cmds
    )
    # the shell state comes before the first command that needs .venv
    first_venv = next(
        i for i, c in enumerate(cmds) if c.split()[0] in ("python", "dtrain", "torchrun")
    )
    assert any(is_state(c) and ".venv/bin/activate" in c for c in cmds[:first_venv])
    assert all(
        "runs/" not in c.replace("results/", "") for c in cmds
    )  # results go under results/ (ignored)


def test_every_readme_command_resolves_as_the_readme_says():
    from dtrain.cli.main import build_parser

    makefile = (REPO / "Makefile").read_text()
    for cmd in commands():
        words = shlex.split(cmd)
        if is_state(cmd):
            continue
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, flags=re.M), cmd
        elif words[0] == "dtrain":
            if "<" in cmd:  # a placeholder: the subcommand and flags still parse
                words = [w if "<" not in w else "x" for w in words]
            build_parser().parse_args(words[1:])
        elif module_and_args(cmd):
            module, args = module_and_args(cmd)
            spec = importlib.util.find_spec(module)
            assert spec is not None, cmd
            main = importlib.import_module(
                f"{module}.__main__" if spec.submodule_search_locations else module
            ).main
            main.check(
                args
            )  # unknown keys, wrong types, every sweep point: as `python -m` checks them
        else:
            assert (REPO / words[0]).exists() and os.access(REPO / words[0], os.X_OK), cmd


def _state_lines(upto: int) -> list[str]:
    return [c for c in commands()[:upto] if is_state(c)]


def bare_shell(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`script` in bash with a new login's environment: the system PATH, no virtual environment."""
    env = {
        "PATH": SYSTEM_PATH,
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_activation_puts_the_venv_first_in_a_new_shell():
    if not (REPO / ".venv" / "bin" / "activate").exists():
        pytest.skip(".venv is made by make test / make capstone (scripts/setup-venv)")
    state = _state_lines(len(commands()))
    out = bare_shell(
        "command -v python || echo 'no python'\n" + "\n".join(state) + "\ncommand -v python dtrain",
        REPO,
        30,
    )
    assert out.returncode == 0, out.stderr
    found = out.stdout.split()
    assert found[-2:] == [str(REPO / ".venv/bin/python"), str(REPO / ".venv/bin/dtrain")]
    assert ".venv" not in found[0]  # without the README's line, a new shell has none of it


@pytest.mark.slow
def test_readme_local_commands_run_in_a_new_shell(tmp_path):
    """Each local command, small, in a scratch folder whose .venv is the repo's (~1.5 min on 2
    cores)."""
    if not (REPO / ".venv" / "bin" / "activate").exists():
        pytest.skip(".venv is made by make test / make capstone (scripts/setup-venv)")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    # the README's scripts/ commands and the measurements `dtrain backtest --measured` reads,
    # as from the checkout (read only)
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    (tmp_path / "measured").symlink_to(REPO / "measured")
    ran = []
    for i, cmd in enumerate(commands()):
        if is_state(cmd) or not_local(cmd):
            continue
        found = module_and_args(cmd)
        if cmd.startswith("torchrun") and not (REPO / ".venv" / "bin" / "torchrun").exists():
            # a venv sharing another's site-packages has no torchrun script (a fresh one has)
            continue
        small = " ".join(SMALL.get(found[0] if found else cmd.split()[0], []))
        out = bare_shell("\n".join(_state_lines(i) + [f"{cmd} {small}"]), tmp_path, 240)
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        ran.append(cmd)
    assert len(ran) >= 6, ran
    assert list((tmp_path / "results" / "try1" / "tp-attention").glob("*/summary.json"))
