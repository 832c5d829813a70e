"""convert_gpt2 (tools/tessera_tools/convert_gpt2.py): a Hugging Face GPT-2 checkpoint written by
tools/reference/gen_gpt.py (tests/data/gpt2_hf_tiny.safetensors: GPT2Model's names, Conv1D weights
stored (in, out), the causal-mask buffers) becomes exactly the nanoGPT-named state dict that the C++
GPT test checks against PyTorch (tests/data/gpt.safetensors, case gpt_tiny); bad checkpoints fail
naming the key.

    python3 -m pytest -q tests/tools/test_convert_gpt2.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")  # the converter reads and writes arrays (python3-numpy)

from conftest import TOOLS  # noqa: E402
from tessera_tools import safetensors_io  # noqa: E402
from tessera_tools.convert_gpt2 import ConversionError, convert  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"


def hf_tiny() -> dict[str, Any]:
    tensors, _ = safetensors_io.load(str(DATA / "gpt2_hf_tiny.safetensors"))
    return {k: np.array(v) for k, v in tensors.items()}


def test_converts_to_nanogpt_names_order_and_layout(tmp_path: Path) -> None:
    out = tmp_path / "gpt.safetensors"
    r = subprocess.run([sys.executable, str(TOOLS / "convert_gpt2.py"), str(DATA / "gpt2_hf_tiny.safetensors"),
                        str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "n_layer=2 n_embd=8 vocab_size=11 block_size=8" in r.stdout
    converted, metadata = safetensors_io.load(str(out))
    reference, ref_meta = safetensors_io.load(str(DATA / "gpt.safetensors"))
    keys = ref_meta["gpt_tiny.keys"].split(",")
    assert list(converted) == keys  # nanoGPT's state_dict order, lm_head.weight last
    for key in keys:
        want = reference[f"gpt_tiny.{key}"].astype(np.float32)
        assert converted[key].shape == want.shape, key
        np.testing.assert_array_equal(converted[key], want, err_msg=key)
    assert metadata["format"] == "pt"


def test_lm_head_prefix_and_tie() -> None:
    source = {"transformer." + k: v for k, v in hf_tiny().items()}
    source["lm_head.weight"] = source["transformer.wte.weight"].copy()
    state, layout = convert(source)  # GPT2LMHeadModel's names: the same result
    assert layout.n_layer == 2
    np.testing.assert_array_equal(state["lm_head.weight"], state["transformer.wte.weight"])
    source["lm_head.weight"] = source["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match="lm_head.weight differs"):
        convert(source)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("h.1.mlp.c_fc.bias"), r"missing keys \['h.1.mlp.c_fc.bias'\]"),
    (lambda t: t.update({"h.0.attn.extra": np.zeros(2, np.float32)}), r"unknown keys \['h.0.attn.extra'\]"),
    (lambda t: t.update({"h.0.attn.c_attn.weight": np.zeros((24, 8), np.float32)}),
     r"h.0.attn.c_attn.weight: shape \(24, 8\)"),
    (lambda t: t.pop("wpe.weight"), "missing key 'wpe.weight'"),
])
def test_bad_checkpoints_name_the_key(edit: Any, message: str) -> None:
    tensors = hf_tiny()
    edit(tensors)
    with pytest.raises(ConversionError, match=message):
        convert(tensors)
