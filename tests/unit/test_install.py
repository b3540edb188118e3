"""The skip reason of the tests that need torch.compile's C++ toolchain."""

import sys
import sysconfig

from tests.helpers import cxx_compiler_problem


def test_compile_skip_reason_names_the_missing_compiler_or_headers(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler++")
    assert "no-such-compiler++ not found" in cxx_compiler_problem()
    monkeypatch.setenv("CXX", sys.executable)  # any executable passes the compiler check
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert f"no Python.h in {tmp_path}" in cxx_compiler_problem()

