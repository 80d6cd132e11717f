"""env.json names the host CPU: eager PyTorch's issue time per op is the host's."""

from dtrain.run import envinfo

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R)  Platinum 8480+
flags\t\t: fpu vme

processor\t: 1
model name\t: Intel(R) Xeon(R)  Platinum 8480+
"""


def test_cpu_model_is_cpuinfos_first_model_name(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    assert envinfo.cpu_model(f) == "Intel(R) Xeon(R) Platinum 8480+"


def test_cpu_model_falls_back_to_the_platform_without_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setattr(envinfo.platform, "processor", lambda: "arm")
    assert envinfo.cpu_model(tmp_path / "absent") == "arm"
    (tmp_path / "empty").write_text("processor\t: 0\n")
    assert envinfo.cpu_model(tmp_path / "empty") == "arm"
    monkeypatch.setattr(envinfo.platform, "processor", lambda: "")
    assert envinfo.cpu_model(tmp_path / "absent") is None


def test_env_json_records_the_cpu_model():
    facts = envinfo.collect(backend="gloo", world_size=1, device="cpu", launcher="local")
    assert facts["cpu_model"] == envinfo.cpu_model()
