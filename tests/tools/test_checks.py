"""The repository checks and the checkpoint reader: the checks' self-tests (each finds the faults
of a made-up tree), the include order of this tree's headers, the precompiled header's command
(made from a reference unit's), and a safetensors file written and listed back.

    python3 -m pytest -q tests/tools/test_checks.py
"""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

from conftest import ROOT
from tessera_tools import precompile
from tessera_tools.checks import api_docs, compile_fail, headers


def test_headers_self_test() -> None:
    assert headers.self_test() == 0


def test_api_docs_self_test() -> None:
    assert api_docs.self_test() == 0


def test_include_order_of_this_tree() -> None:
    roots = [ROOT / "include"] + sorted((ROOT / "communicators").glob("*/include"))
    assert headers.order_violations(roots) == []


REFERENCE = ("ccache c++ -Isrc/pch/pch_reference.p -I../include -DNDEBUG -std=c++20 -O1 -isystem/usr/include/eigen3 "
             "-DTESSERA_COMPILED_KERNELS -MD -MQ src/pch/pch_reference.p/reference.cpp.o "
             "-MF src/pch/pch_reference.p/reference.cpp.o.d -o src/pch/pch_reference.p/reference.cpp.o "
             "-c ../src/pch/reference.cpp").split()


def test_precompile_keeps_every_option_and_replaces_the_outputs() -> None:
    cmd = precompile.header_command(REFERENCE, "h.hpp", "h.hpp.gch", "h.d")
    # The launcher (ccache) goes, every flag stays in order, the reference's source, object and
    # dependency options are replaced by the header's.
    assert cmd == ["c++", "-Isrc/pch/pch_reference.p", "-I../include", "-DNDEBUG", "-std=c++20", "-O1",
                   "-isystem/usr/include/eigen3", "-DTESSERA_COMPILED_KERNELS",
                   "-x", "c++-header", "h.hpp", "-o", "h.hpp.gch", "-MD", "-MQ", "h.hpp.gch", "-MF", "h.d"]


def test_precompile_refuses_a_command_without_a_source() -> None:
    with pytest.raises(ValueError, match="compiles no source"):
        precompile.header_command(["c++", "-O1", "-o", "x.o"], "h.hpp", "h.hpp.gch", "h.d")


def test_precompile_wants_exactly_one_reference(tmp_path: pathlib.Path) -> None:
    compdb = tmp_path / "compile_commands.json"
    entry = {"directory": str(tmp_path), "command": " ".join(REFERENCE), "file": "../src/pch/reference.cpp",
             "output": "src/pch/pch_reference.p/reference.cpp.o"}
    compdb.write_text(json.dumps([entry, entry]))
    with pytest.raises(ValueError, match="2 entries"):
        precompile.reference_entry(compdb, "src/pch/pch_reference.p/")
    compdb.write_text(json.dumps([entry]))
    assert precompile.reference_entry(compdb, "src/pch/pch_reference.p/") == entry
    assert precompile.main(["--compdb", str(compdb), "--reference", "elsewhere.p/", "--header", "h.hpp",
                            "--output", "h.hpp.gch", "--depfile", "h.d"]) == 1


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (Debian: g++)")
def test_precompiled_header_is_used(tmp_path: pathlib.Path) -> None:
    """End to end with g++: the .gch made from the reference's command is the one a unit with the
    same options takes (-H marks it with '!')."""
    (tmp_path / "h.hpp").write_text("#include <vector>\n")
    (tmp_path / "ref.cpp").write_text("int main() { return 0; }\n")
    (tmp_path / "a.cpp").write_text("int main() { return static_cast<int>(std::vector<int>{}.size()); }\n")
    flags = ["g++", "-std=c++20", "-O1", "-DX=1"]
    compdb = tmp_path / "compile_commands.json"
    compdb.write_text(json.dumps([{"directory": str(tmp_path), "file": "ref.cpp", "output": "ref.p/ref.o",
                                   "command": " ".join(flags + ["-MD", "-MQ", "ref.p/ref.o", "-MF", "ref.p/ref.o.d",
                                                                "-o", "ref.p/ref.o", "-c", "ref.cpp"])}]))
    assert precompile.main(["--compdb", str(compdb), "--reference", "ref.p/", "--header", "h.hpp",
                            "--output", "h.hpp.gch", "--depfile", "h.d"]) == 0
    assert (tmp_path / "h.hpp.gch").is_file() and "vector" in (tmp_path / "h.d").read_text()
    r = subprocess.run(flags + ["-include", "h.hpp", "-H", "-fsyntax-only", "a.cpp"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.startswith("! "), r.stderr[:500]


@pytest.mark.skipif(shutil.which("clang++") is None, reason="needs clang++ (Debian: clang)")
def test_precompiled_header_is_used_by_clang(tmp_path: pathlib.Path) -> None:
    """The same with clang (src/pch/meson.build): a .pch made with -fpch-instantiate-templates is
    the one a unit with `-include h.hpp` loads (clang's -print-stats names the files it loaded)."""
    (tmp_path / "h.hpp").write_text("#include <vector>\n")
    (tmp_path / "a.cpp").write_text("int main() { return static_cast<int>(std::vector<int>{}.size()); }\n")
    flags = ["clang++", "-std=c++20", "-O1", "-DX=1"]
    use = flags + ["-include", "h.hpp", "-Xclang", "-print-stats", "-fsyntax-only", "a.cpp"]
    compdb = tmp_path / "compile_commands.json"
    compdb.write_text(json.dumps([{"directory": str(tmp_path), "file": "ref.cpp", "output": "ref.p/ref.o",
                                   "command": " ".join(flags + ["-o", "ref.p/ref.o", "-c", "ref.cpp"])}]))
    text = subprocess.run(use, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "h.hpp.pch" not in text.stderr
    assert precompile.main(["--compdb", str(compdb), "--reference", "ref.p/", "--header", "h.hpp",
                            "--output", "h.hpp.pch", "--depfile", "h.d",
                            "--extra-arg=-fpch-instantiate-templates"]) == 0
    r = subprocess.run(use, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "h.hpp.pch" in r.stderr, r.stderr[-500:]


def test_compile_fail_counts_lines_without_the_include_chain(tmp_path: pathlib.Path) -> None:
    """A made-up compiler that fails with an include chain and two lines of diagnostics: the
    chain is not counted against `// max-lines:`, the diagnostics are."""
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\n"
                        "echo 'In file included from a.hpp:3,' >&2\n"
                        "echo '                 from s.cpp:1:' >&2\n"
                        "echo 'In file included from b.hpp:9:' >&2\n"
                        "echo 's.cpp:2:1: error: the sentence' >&2\n"
                        "echo 's.cpp:2:1: note: a note' >&2\n"
                        "exit 1\n")
    compiler.chmod(0o755)
    source = tmp_path / "s.cpp"
    source.write_text("// expect: the sentence\n// max-lines: 2\n")
    report, ok = compile_fail.check(source, [str(compiler)])
    assert ok, report
    source.write_text("// expect: the sentence\n// max-lines: 1\n")
    report, ok = compile_fail.check(source, [str(compiler)])
    assert not ok and "2 lines of compiler output" in report, report


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
