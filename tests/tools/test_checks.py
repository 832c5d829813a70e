"""The repository checks and the checkpoint reader: the checks' self-tests (each finds the faults
of a made-up tree), the include order of this tree's headers, and a safetensors file written and
listed back.

    python3 -m pytest -q tests/tools/test_checks.py
"""
from __future__ import annotations

import pathlib

import pytest

from conftest import ROOT
from tessera_tools.checks import api_docs, headers


def test_headers_self_test() -> None:
    assert headers.self_test() == 0


def test_api_docs_self_test() -> None:
    assert api_docs.self_test() == 0


def test_include_order_of_this_tree() -> None:
    roots = [ROOT / "include"] + sorted((ROOT / "communicators").glob("*/include"))
    assert headers.order_violations(roots) == []


def test_checkpoint_listed(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    np = pytest.importorskip("numpy")
    from tessera_tools import checkpoint, safetensors_io

    path = str(tmp_path / "c.safetensors")
    safetensors_io.save(path, {"fc.weight": np.ones((2, 3), dtype=np.float32), "step": np.array([7], dtype=np.int64)},
                        {"epoch": 3})
    tensors, metadata = safetensors_io.load(path)
    assert metadata == {"epoch": "3"}
    assert tensors["fc.weight"].shape == (2, 3) and tensors["step"][0] == 7
    assert checkpoint.main([path]) == 0
    out = capsys.readouterr().out
    assert "epoch = 3" in out and "fc.weight" in out and "|x|=2.44949" in out and "2 tensors, 7 values" in out
