"""`dtrain capstone --measured`: the committed GPU measurements the guide reads besides the capstone's runs."""
from __future__ import annotations

import pytest

from dtrain.capstone import gpu_measurements
from dtrain.errors import UserError


def test_measured_folder_is_read_when_present_and_refused_when_named_but_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert gpu_measurements("measured") == []          # the default, in a checkout without measured/
    assert gpu_measurements("none") == []
    (tmp_path / "measured").mkdir()
    assert gpu_measurements("measured") == ["measured"]
    with pytest.raises(UserError, match=r"--measured nope: no such folder: .* or --measured none"):
        gpu_measurements("nope")
    from dtrain.cli import main

    assert main(["capstone", "--measured", "nope", "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --measured nope: no such folder: give the folder `make gpu-check` reports were copied to, "
                   "or --measured none"]
    assert not (tmp_path / "r").exists()   # refused before anything was written
