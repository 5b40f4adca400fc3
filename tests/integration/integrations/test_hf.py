"""Hugging Face integration: AttnResConfig / AttnResForCausalLM, save/load, generate, export-hf."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from attention_residuals import cli  # noqa: E402
from attention_residuals.connections import ResidualConfig  # noqa: E402
from attention_residuals.integrations.hf import (  # noqa: E402
    AttnResConfig,
    AttnResForCausalLM,
    config_from_gpt,
    export_hf,
    from_gpt,
    gpt_config_of,
    to_gpt,
)
from attention_residuals.kernels import use_backend  # noqa: E402
from attention_residuals.model import GPT, GPTConfig  # noqa: E402
from attention_residuals.training.checkpoint import read_checkpoint, save_checkpoint  # noqa: E402
from attention_residuals.training.data import byte_encode  # noqa: E402


def tiny(residual="block", **kw):
    base = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=40, residual=residual)
    if residual == "block":
        base["block_size"] = 3  # L = 4: blocks [0..2], [3] (a partial last block)
    base.update(kw)
    return GPTConfig(**base)


def trained_like(config: GPTConfig) -> GPT:
    """A GPT whose depth parameters are not at their (trivially symmetric) zero init."""
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


@pytest.fixture
def idx():
    return torch.randint(0, 64, (2, 9))


def test_config_aliases_and_validation(tmp_path):
    c = AttnResConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, residual="full")
    assert (c.d_model, c.n_layer, c.n_head, c.residual["rule"]) == (48, 3, 4, "full")
    assert c.hidden_size == 48 and c.num_hidden_layers == 3 and c.tie_word_embeddings is False
    g = gpt_config_of(c)
    assert g == GPTConfig(d_model=48, n_layer=3, n_head=4, residual="full")
    assert gpt_config_of(config_from_gpt(g)) == g
    c.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(back, AttnResConfig) and gpt_config_of(back) == g
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "attnres"
    with pytest.raises(ValueError, match="residual"):
        AttnResConfig(residual="nope")
    # an export written before the residual config was nested (flat options, `heads`) still loads
    old = AttnResConfig(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=4, residual="block", n_blocks=3, heads=2
    )
    assert gpt_config_of(old).residual == ResidualConfig("block", n_blocks=3, depth_heads=2)
    with pytest.raises(ValueError, match="contradicts"):
        AttnResConfig(hidden_size=32, d_model=64)


def test_a_fresh_hf_model_draws_its_queries_as_asked():
    """From a config (no weights): queries zero by default, drawn at ``query_init_std`` when set."""

    def queries(**kw):
        cfg = AttnResConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, residual=dict(rule="full", **kw)
        )
        return AttnResForCausalLM(cfg).model.residual.queries.detach()

    assert torch.count_nonzero(queries()) == 0 and 0.3 < float(queries(query_init_std=0.5).std()) < 0.7


RULES = [
    ("prenorm", {}),
    ("full", {}),
    ("block", {"key_norm_gain": True, "depth_heads": 2}),
    ("block", {"query": "lowrank", "intra_gate": True}),
    ("full", {"query": "input", "normalize": "sigmoid", "key_norm": False}),
    ("swa", {"window": 2}),
    ("mixing", {}),
    ("denseformer", {}),
    ("mhc", {"streams": 3}),
]


@pytest.mark.parametrize("residual,options", RULES)
def test_from_pretrained_gives_identical_logits(tmp_path, idx, residual, options):
    """Every rule: the HF model computes the GPT's reference formulas bit for bit (and the GPT's
    default kernels to float rounding)."""
    ours = trained_like(tiny(residual, **options))
    from_gpt(ours).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, AttnResForCausalLM)
    with torch.no_grad():
        got = loaded(idx).logits
        torch.testing.assert_close(got, ours(idx), rtol=1e-5, atol=1e-5)
        with use_backend("reference"):
            torch.testing.assert_close(got, ours(idx), rtol=0, atol=0)
    # parameter names are ours under "model."; back to a GPT bit for bit
    assert set(loaded.state_dict()) == {f"model.{k}" for k in ours.state_dict()}
    back = to_gpt(loaded)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_tied_embeddings_survive_the_round_trip(tmp_path, idx):
    ours = trained_like(tiny("block", tie_embeddings=True))
    from_gpt(ours).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed.weight.data_ptr()
    with torch.no_grad(), use_backend("reference"):
        torch.testing.assert_close(loaded(idx).logits, ours(idx), rtol=0, atol=0)


def test_labels_give_the_shifted_next_token_loss(idx):
    ours = trained_like(tiny())
    hf = from_gpt(ours)
    with torch.no_grad():
        out = hf(idx, labels=idx)
        _, ref = ours(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(out.loss, ref)
    labels = idx.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        masked = hf(idx, labels=labels).loss
        _, ref2 = ours(idx[:, :-1], torch.where(labels[:, 1:] == -100, -1, labels[:, 1:]))
    torch.testing.assert_close(masked, ref2)


def test_generate_greedy_equals_our_generate(tmp_path, idx):
    ours = trained_like(tiny())
    from_gpt(ours).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with use_backend("reference"):  # the formulas the HF model computes: the same argmax every step
        expected = ours.generate(idx, 12, temperature=0)
        assert torch.equal(ours.generate(idx, 12, temperature=0, use_cache=False), expected)
    for kwargs in ({}, {"use_cache": False}, {"cache_implementation": "static"}):
        got = hf.generate(idx, max_new_tokens=12, do_sample=False, **kwargs)
        assert torch.equal(got, expected), kwargs
    # beam search with one beam is greedy; several beams run (the cache is reordered by HF)
    assert torch.equal(hf.generate(idx, max_new_tokens=5, num_beams=1, do_sample=False), expected[:, :14])
    beams = hf.generate(idx, max_new_tokens=5, num_beams=3, do_sample=False)
    assert beams.shape == (2, 14) and torch.equal(beams[:, :9], idx)


def test_generate_sampling(idx):
    hf = from_gpt(trained_like(tiny())).eval()
    torch.manual_seed(1)
    a = hf.generate(idx, max_new_tokens=10, do_sample=True, top_k=8, temperature=0.9)
    torch.manual_seed(1)
    b = hf.generate(idx, max_new_tokens=10, do_sample=True, top_k=8, temperature=0.9)
    assert a.shape == (2, 19) and torch.equal(a, b) and torch.equal(a[:, :9], idx)
    assert int(a.max()) < 64
    # top_k=1 sampling is greedy
    greedy = hf.generate(idx, max_new_tokens=6, do_sample=False)
    assert torch.equal(hf.generate(idx, max_new_tokens=6, do_sample=True, top_k=1), greedy)


def test_cache_forward_matches_full_forward(idx):
    hf = from_gpt(trained_like(tiny())).eval()
    with torch.no_grad():
        full = hf(idx, use_cache=False).logits
        first = hf(idx[:, :5], use_cache=True)
        rest = hf(idx[:, 5:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full, rtol=1e-5, atol=1e-5)
    assert rest.cache.get_seq_length() == 9


def test_bad_inputs_are_rejected_with_the_argument_named(idx):
    hf = from_gpt(trained_like(tiny())).eval()
    with pytest.raises(ValueError, match="input_ids / inputs_embeds"):
        hf()
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 7))
    with pytest.raises(ValueError, match="input_ids"):
        hf(torch.full((1, 3), 64))
    with pytest.raises(ValueError, match="attention_mask"):
        hf(idx, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="labels"):
        hf(idx, labels=idx[:, :3])
    with pytest.raises(ValueError, match="position_ids"):
        hf(idx, position_ids=torch.full_like(idx, -1))


def make_run(run_dir, model: GPT, tokenizer=None, dtype="float32"):
    """A run directory as ``attnres train`` writes it (config.json + checkpoint.safetensors)."""
    record = {
        "format": 1,
        "model": model.config.to_dict(),
        "train": {"steps": 1, "dtype": dtype},
        "data": {"tokenizer": "bytes"},
    }
    if tokenizer is not None:
        record["train"]["tokenizer"] = str(tokenizer)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(record))
    identity = {k: record[k] for k in ("model", "train", "data")}
    save_checkpoint(run_dir / "checkpoint.safetensors", model=model, step=1, config=identity)


def test_export_hf_and_back_is_lossless(tmp_path, idx, capsys):
    ours = trained_like(tiny("block", vocab_size=256))
    make_run(tmp_path / "run", ours)
    assert cli.main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad(), use_backend("reference"):
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=0, atol=0)
    # a byte-level run ships the byte tokenizer: AutoTokenizer ids are our byte tokens
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return 'héllo ✓'"
    assert tok.encode(text, add_special_tokens=False) == byte_encode(text)
    # and back to a run directory: the same tensors, bit for bit
    assert cli.main(["export-hf", "--import", str(tmp_path / "hf"), str(tmp_path / "run2")]) == 0
    before, _ = read_checkpoint(tmp_path / "run" / "checkpoint.safetensors")
    after, info = read_checkpoint(tmp_path / "run2" / "checkpoint.safetensors")
    model_keys = {k for k in before if k.startswith("model/")}
    assert model_keys == {k for k in after if k.startswith("model/")}
    for k in model_keys:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    assert GPTConfig.from_dict(info["config"]["model"]) == ours.config
    record = json.loads((tmp_path / "run2" / "config.json").read_text())
    assert GPTConfig.from_dict(record["model"]) == ours.config
    original = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (
        record["train"] == original["train"] and record["data"] == original["data"]
    )  # eval finds its corpus


def test_export_hf_dtype_and_tokenizer(tmp_path, idx):
    pytest.importorskip("tokenizers")
    from attention_residuals.training.tokenizer import train_bpe

    tok = train_bpe(["def foo(bar):\n    return bar + 1\n"] * 20, vocab_size=300, min_frequency=2)
    tok.save_pretrained(tmp_path / "tok")
    ours = trained_like(tiny("full", vocab_size=len(tok)))
    make_run(tmp_path / "run", ours, tokenizer=tmp_path / "tok")
    export_hf(tmp_path / "run", tmp_path / "hf", dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.model.embed.weight.dtype == torch.bfloat16
    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf")
    # generate stops at the tokenizer's end of text and pads with it (the tokenizer had no pad token)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eot and generation["pad_token_id"] == eot
    assert hf.generation_config.eos_token_id == eot and loaded.pad_token_id == eot
    assert loaded.padding_side == "left"
    text = "def foo(bar): return bar"
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "trained, flag, written",
    [
        ("bfloat16", [], torch.bfloat16),  # the precision the run trained in
        ("float32", [], torch.float32),
        ("bfloat16", ["--dtype", "float32"], torch.float32),
    ],
)
def test_export_hf_writes_the_run_precision_by_default(tmp_path, capsys, trained, flag, written):
    make_run(tmp_path / "run", trained_like(tiny("block", vocab_size=256)), dtype=trained)
    assert cli.main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf"), *flag]) == 0
    name = str(written).removeprefix("torch.")
    assert f"({name} weights, step 1)" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert hf.model.embed.weight.dtype == written
    assert json.loads((tmp_path / "hf" / "attnres_export.json").read_text())["dtype"] == name


def test_export_hf_errors_name_the_problem(tmp_path, capsys):
    assert cli.main(["export-hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_non_empty_folder_and_import_never_replaces_a_checkpoint(tmp_path, capsys):
    ours = trained_like(tiny("block", vocab_size=256))
    make_run(tmp_path / "run", ours)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    assert cli.main(["export-hf", str(tmp_path / "run"), str(tmp_path / "busy")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert cli.main(["export-hf", str(tmp_path / "run"), str(tmp_path / "empty")]) == 0
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary folder left behind
    # --import into the live run: refused, with or without --force; the checkpoint is untouched
    before = (tmp_path / "run" / "checkpoint.safetensors").read_bytes()
    for extra in ([], ["--force"]):
        assert (
            cli.main(["export-hf", "--import", str(tmp_path / "empty"), str(tmp_path / "run"), *extra]) == 2
        )
        assert "checkpoint.safetensors" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoint.safetensors").read_bytes() == before
    # a folder holding other files needs --force
    assert cli.main(["export-hf", "--import", str(tmp_path / "empty"), str(tmp_path / "busy")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (
        cli.main(["export-hf", "--import", str(tmp_path / "empty"), str(tmp_path / "busy"), "--force"]) == 0
    )
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "busy" / "checkpoint.safetensors").is_file()
