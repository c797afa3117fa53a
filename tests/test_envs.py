"""minivllm/envs.py: every MINIVLLM_* variable read in one place, each read seeing the environment of the moment,
and a value a switch cannot take refused with the variable's name."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from minivllm import envs

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "minivllm"


def test_defaults(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    assert envs.MINIVLLM_CACHE == Path.home() / ".cache" / "minivllm"
    assert envs.MINIVLLM_API_KEY is None
    assert envs.MINIVLLM_DISABLE_FUSIONS is False
    assert envs.MINIVLLM_PDL is True and envs.MINIVLLM_TUNED_CONFIGS is True
    assert sorted(dir(envs)) == sorted(envs.environment_variables)


def test_each_read_sees_the_current_value(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("MINIVLLM_DISABLE_FUSIONS", "1")
    monkeypatch.setenv("MINIVLLM_API_KEY", "secret")
    assert envs.MINIVLLM_CACHE == tmp_path and envs.MINIVLLM_DISABLE_FUSIONS and envs.MINIVLLM_API_KEY == "secret"
    monkeypatch.setenv("MINIVLLM_DISABLE_FUSIONS", "")
    assert envs.MINIVLLM_DISABLE_FUSIONS is False


def test_switches_take_0_or_1(monkeypatch):
    monkeypatch.setenv("MINIVLLM_TUNED_CONFIGS", "false")
    with pytest.raises(ValueError, match="MINIVLLM_TUNED_CONFIGS must be 0 or 1"):
        envs.MINIVLLM_TUNED_CONFIGS
    with pytest.raises(AttributeError):
        envs.MINIVLLM_NOT_A_VARIABLE


def test_no_other_module_reads_minivllm_variables():
    read = re.compile(r"""(environ(\.get)?|getenv)\s*[(\[]\s*["']MINIVLLM_""")
    readers = [str(path.relative_to(PACKAGE_ROOT)) for path in PACKAGE_ROOT.rglob("*.py")
               if path.name != "envs.py" and read.search(path.read_text())]
    assert not readers, f"read MINIVLLM_* through minivllm.envs instead: {readers}"
