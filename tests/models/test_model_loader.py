"""load_model: checkpoint layouts, dtypes, and errors that name the file and weight."""

from __future__ import annotations

import json

import pytest
import torch
from paged_driver import PagedDriver
from safetensors.torch import load_file, save_file

from hybridserve.models import CheckpointError, ConfigError, load_model
from hybridserve.models.hybrid import GraniteMoeHybridForCausalLM, NemotronHForCausalLM
from hybridserve.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return make_tiny_checkpoint(
        "granitemoehybrid", tmp_path_factory.mktemp("g"), seed=5, layers="MAM"
    )


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def _logits(model, tokens):
    logits, _ = PagedDriver(model).step([(0, tokens)])
    return logits


def test_loads_with_checkpoint_names(granite):
    model = load_model(granite)
    assert isinstance(model, GraniteMoeHybridForCausalLM)
    file_weights = load_file(str(granite / "model.safetensors"))
    assert set(model.state_dict()) == set(file_weights)
    for name, t in model.state_dict().items():
        assert torch.equal(t, file_weights[name]), name
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_weights_are_aligned_whatever_the_file_layout(granite, tmp_path):
    """Every parameter sits on the allocator's alignment, also where the file put a
    tensor at an odd offset (a one-element tensor ahead of each weight shifts the rest by
    4 bytes): the CPU's matrix kernels round differently on differently aligned operands,
    so the same weights must give the same logits whichever file they came from."""
    from hybridserve.models.loader import WEIGHT_ALIGNMENT

    weights = load_file(str(granite / "model.safetensors"))
    shifted = {}
    for name in sorted(weights):
        shifted[f"{name}.pad"] = torch.zeros(1)
        shifted[name] = weights[name]
    out = tmp_path / "shifted"
    out.mkdir()
    (out / "config.json").write_text((granite / "config.json").read_text())
    save_file(shifted, str(out / "model.safetensors"))
    # The index names the weights only: the loader reads what it lists.
    index = {"weight_map": {name: "model.safetensors" for name in weights}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(out)
    for name, t in model.state_dict().items():
        assert t.data_ptr() % WEIGHT_ALIGNMENT == 0, name
    tokens = list(range(3, 13))
    torch.testing.assert_close(_logits(model, tokens), _logits(load_model(granite), tokens),
                               rtol=0, atol=0)


def test_sharded_checkpoint_loads_the_same(granite, tmp_path):
    weights = load_file(str(granite / "model.safetensors"))
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((granite / "config.json").read_text())
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(out / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    tokens = torch.randint(3, 256, (12,)).tolist()
    assert torch.equal(_logits(load_model(out), tokens), _logits(load_model(granite), tokens))

    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="model-00002-of-00002.safetensors: shard file is missing"
    ):
        load_model(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "bf16", torch.float16, "float16"])
def test_low_precision_load(granite, dtype):
    model = load_model(granite, dtype=dtype)
    want = torch.bfloat16 if "b" in str(dtype) else torch.float16
    assert all(p.dtype == want for p in model.parameters())
    tokens = torch.randint(3, 256, (20,)).tolist()
    low = _logits(model, tokens)
    full = _logits(load_model(granite), tokens)
    assert low.dtype == torch.float32
    # Measured over 15 prompts on each of three tiny checkpoints: the largest error
    # relative to the largest logit 0.0097 (0.013 on another checkpoint) in bf16 and
    # 0.0013 in float16. Bounds about 3x those.
    bound = 0.03 if want == torch.bfloat16 else 0.004
    err = (low - full).abs().max()
    assert (err / full.abs().max()).item() < bound
    # A random tiny model has near-tied logits, so a few argmaxes may flip (mostly none
    # or one of 20; a fixed share would fail now and then). Each flip must be a
    # near-tie: the full-precision logits of the two picks no further apart than the
    # two errors could carry them.
    pick_low, pick_full = low.argmax(-1), full.argmax(-1)
    rows = torch.arange(len(tokens))
    gap = full[rows, pick_full] - full[rows, pick_low]
    flips = pick_low != pick_full
    assert (gap[flips] <= 2 * err).all(), (gap[flips], err)
    assert flips.float().mean() <= 0.25


def test_rejects_unsupported_dtype(granite):
    with pytest.raises(ValueError, match="dtype=torch.int8 is not supported"):
        load_model(granite, dtype=torch.int8)


def test_missing_weight(granite, tmp_path):
    path = _copy(granite, tmp_path / "c")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: missing weight.*layers\.1\.self_attn\.k_proj"
    ):
        load_model(path)


def test_unexpected_weight(granite, tmp_path):
    path = _copy(granite, tmp_path / "c")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.mamba.extra_bias"] = torch.zeros(3)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected weight.*extra_bias"):
        load_model(path)


def test_shape_mismatch(granite, tmp_path):
    path = _copy(granite, tmp_path / "c")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.mamba.in_proj.weight"] = weights["model.layers.0.mamba.in_proj.weight"][
        :-1
    ]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mamba\.in_proj\.weight' has shape"
    ):
        load_model(path)


def test_config_layout_disagreeing_with_weights(granite, tmp_path):
    path = _copy(granite, tmp_path / "c")
    _edit_config(path, layer_types=["mamba", "mamba", "mamba"])
    with pytest.raises(CheckpointError, match="missing weight"):
        load_model(path)


@pytest.mark.parametrize("keep", [0, 100, 5000])
def test_truncated_or_garbage_file(granite, tmp_path, keep):
    path = _copy(granite, tmp_path / "c")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:keep] if keep else b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable or truncated"):
        load_model(path)


def test_no_weights(granite, tmp_path):
    path = _copy(granite, tmp_path / "c")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load_model(path)


def test_config_errors_surface_from_load_model(granite, tmp_path):
    path = _copy(granite, tmp_path / "arch")
    _edit_config(path, architectures=["MambaForCausalLM"])
    with pytest.raises(ConfigError, match="supported: GraniteMoeHybridForCausalLM"):
        load_model(path)
    path = _copy(granite, tmp_path / "experts")
    _edit_config(path, num_local_experts=8, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_model(path)


def test_dense_checkpoint_with_expert_config_names_the_missing_experts(granite, tmp_path):
    path = _copy(granite, tmp_path / "experts")
    _edit_config(path, num_local_experts=8)
    with pytest.raises(CheckpointError, match=r"missing weight\(s\).*block_sparse_moe"):
        load_model(path)


def test_nemotron_prefixes_and_mtp_weights(tmp_path):
    """Nemotron-H files name the backbone ``backbone.*`` (also accepted: ``model.*``);
    multi-token-prediction weights are not used and are skipped."""
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "n", layers="M*-")
    weights = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("backbone.") for k in weights)
    model = load_model(path)
    assert isinstance(model, NemotronHForCausalLM)
    tokens = torch.randint(3, 256, (9,)).tolist()
    expected = _logits(model, tokens)
    renamed = {k.replace("backbone.", "model.", 1): v for k, v in weights.items()}
    renamed["mtp.layers.0.norm.weight"] = torch.ones(64)
    save_file(renamed, str(path / "model.safetensors"))
    assert torch.equal(_logits(load_model(path), tokens), expected)


def test_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint("bamba", tmp_path / "b", layers="MA", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load_model(path)
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(
        model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T
    )


def test_config_with_more_layers_than_the_weights_is_refused_before_building(granite, tmp_path):
    import time

    path = _copy(granite, tmp_path / "c")
    _edit_config(path, num_hidden_layers=4000, layer_types=["mamba"] * 4000)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="4000 decoder layers .* the weights hold 3"):
        load_model(path)
    assert time.perf_counter() - start < 2.0  # no 4000-layer model was built


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(granite, tmp_path, bad):
    path = _copy(granite, tmp_path / "c")
    weights = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name][3, 5] = bad
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"weight '{name}' holds 1 NaN or Inf"):
        load_model(path)


def test_weights_that_overflow_the_load_dtype_are_refused(granite, tmp_path):
    path = _copy(granite, tmp_path / "c")
    weights = load_file(str(path / "model.safetensors"))
    name = "model.embed_tokens.weight"
    # Finite in float16, but their sum is not: the quick check's false alarm, cleared.
    weights[name][0, :2] = 60000.0
    assert not torch.isfinite(weights[name].half().sum())
    save_file(weights, str(path / "model.safetensors"))
    assert load_model(path, dtype="float16").state_dict()[name][0, 0] == 60000.0
    weights[name][0, :2] = 1e30  # finite in float32, Inf in float16
    save_file(weights, str(path / "model.safetensors"))
    load_model(path)  # float32 holds it
    with pytest.raises(CheckpointError, match=rf"weight '{name}' overflows torch.float16"):
        load_model(path, dtype="float16")


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_shard_index_naming_files_outside_the_checkpoint_is_refused(granite, tmp_path, where):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "w.safetensors").write_bytes((granite / "model.safetensors").read_bytes())
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text((granite / "config.json").read_text())
    shard = "../elsewhere/w.safetensors" if where == "parent" else str(outside / "w.safetensors")
    names = load_file(str(granite / "model.safetensors"))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_model(path)
    # The same shard inside the directory, in a subfolder, loads.
    (path / "sub").mkdir()
    (path / "sub" / "w.safetensors").write_bytes((outside / "w.safetensors").read_bytes())
    index["weight_map"] = dict.fromkeys(names, "sub/w.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    load_model(path)
