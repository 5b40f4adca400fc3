"""Exports anyone can load: remote code where attention_residuals is not importable, and the
auto classes registered by ``import attention_residuals`` alone (without importing transformers)."""

import ast
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attention_residuals.connections import ResidualConfig  # noqa: E402
from attention_residuals.integrations import hf_export  # noqa: E402
from attention_residuals.integrations.hf import export_hf  # noqa: E402
from attention_residuals.integrations.hf_export import configuration_attnres  # noqa: E402
from attention_residuals.kernels import use_backend  # noqa: E402
from attention_residuals.model import GPT, GPTConfig  # noqa: E402
from attention_residuals.training.checkpoint import save_checkpoint  # noqa: E402

SRC = Path(__file__).resolve().parents[3] / "src"
BLOCK_IMPORT = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "attention_residuals":
            raise ImportError("attention_residuals is not installed here")
sys.meta_path.insert(0, Block())
try:
    import attention_residuals
except ImportError:
    pass
else:
    raise SystemExit("attention_residuals is still importable")
"""


def exported(tmp_path: Path, residual="block", **kw) -> tuple[Path, GPT]:
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, seq_len=40, residual=residual, **kw)
    torch.manual_seed(0)
    gpt = GPT(config).eval()
    with torch.no_grad():
        for p in gpt.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    run = tmp_path / "run"
    run.mkdir()
    record = {"model": config.to_dict(), "train": {"steps": 1}, "data": {"tokenizer": "bytes"}}
    (run / "config.json").write_text(json.dumps(record))
    save_checkpoint(run / "checkpoint.safetensors", model=gpt, step=1, config=record)
    return export_hf(run, tmp_path / "hf"), gpt


def run_python(code: str, tmp_path: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "HF_MODULES_CACHE": str(tmp_path / "modules"),  # remote code is copied here, not to ~/.cache
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_export_loads_with_remote_code_where_the_package_is_not_importable(tmp_path):
    out, gpt = exported(tmp_path, "block", block_size=3, key_norm_gain=True, depth_heads=2)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnres"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_attnres.AttnResConfig",
        "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
    }
    for name in ("configuration_attnres.py", "modeling_attnres.py", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["pad_token_id"] == 0  # the byte tokenizer pads with byte 0
    ids = torch.randint(1, 256, (2, 9))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad(), use_backend("reference"):
        expected = gpt(ids)
        greedy = gpt.generate(ids[:1, :5], 6, temperature=0)
    code = (
        BLOCK_IMPORT
        + f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
ids = torch.load("ids.pt")
with torch.no_grad():
    torch.save(model(ids).logits, "logits.pt")
torch.save(model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False), "greedy.pt")
tok = AutoTokenizer.from_pretrained({str(out)!r})
batch = tok(["ab", "abcdef"], return_tensors="pt", padding=True)
assert batch["attention_mask"][0].tolist() == [0, 0, 0, 0, 1, 1], batch  # left padding
model.generate(**batch, max_new_tokens=2, do_sample=False)
print("ok")
"""
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=0)
    assert torch.equal(torch.load(tmp_path / "greedy.pt"), greedy)


def test_import_attention_residuals_alone_registers_the_auto_classes(tmp_path):
    out, gpt = exported(tmp_path, "full")
    code = f"""
import sys, torch
import attention_residuals
assert "transformers" not in sys.modules, "import attention_residuals imported transformers"
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(out)!r})  # no trust_remote_code
assert type(model).__module__ == "attention_residuals.integrations.hf_export.modeling_attnres", type(model)
print("ok")
"""
    result = run_python(code, tmp_path, pythonpath=str(SRC))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_the_exported_files_import_only_torch_and_transformers():
    folder = Path(hf_export.__file__).parent
    for name in ("configuration_attnres.py", "modeling_attnres.py"):
        tree = ast.parse((folder / name).read_text())
        roots = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots.add(node.module.split(".")[0])
        assert roots <= {
            "__future__",
            "torch",
            "transformers",
            "math",
            "contextlib",
            "functools",
            "itertools",
            "types",
        }, (
            name,
            roots,
        )


def test_the_exported_config_keeps_the_package_defaults():
    """The standalone config mirrors GPTConfig / ResidualConfig: same fields, same defaults."""
    gpt = GPTConfig()
    assert configuration_attnres.MODEL_DEFAULTS == {
        f.name: getattr(gpt, f.name) for f in fields(GPTConfig) if f.name != "residual"
    }
    assert configuration_attnres.RESIDUAL_DEFAULTS == ResidualConfig().to_dict()
    assert set(configuration_attnres.RULES) == set(__import__("attention_residuals").RESIDUALS)


def readme_snippet(heading: str) -> str:
    text = (SRC.parent / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("heading", ["Share on the Hugging Face Hub", "Patch your Llama"])
def test_readme_snippets_run_as_written(tmp_path, heading):
    result = run_python(readme_snippet(heading), tmp_path, pythonpath=str(SRC))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "torch.Size([2, 8]) torch.Size([2, 3, 64])" if heading.startswith("Share") else "True"
    assert result.stdout.strip().splitlines()[-1] == expected
