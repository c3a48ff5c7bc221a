"""The license the package declares is the one the repository ships."""

from __future__ import annotations

import tomllib

from tests.conftest import ROOT


def test_the_license_file_is_the_apache_license_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == "Apache-2.0"
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert text.count("\n") == 201 and "END OF TERMS AND CONDITIONS" in text
