"""Hub ids (``org/name``) resolve through huggingface_hub's local cache first, honour
HF_HUB_OFFLINE, and fail with a message that names the id and the cache. No test
reaches the network: the cache is a directory laid out as huggingface_hub lays it out,
and the one test that lets a download start points the hub at a closed local port."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cli import main
from hybridserve.hub import ModelNotFoundError, is_hub_id, resolve_model

REPO_ID = "acme/tiny-hybrid"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(hub_dir: Path, checkpoint: Path, repo_id: str = REPO_ID) -> Path:
    """Lay ``checkpoint`` out as huggingface_hub's cache does: blobs named by content,
    a snapshot of symlinks to them, and ``refs/main`` naming the snapshot's commit."""
    repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(checkpoint.iterdir())):
        blob = repo / "blobs" / f"blob{i:02d}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if anything asks huggingface_hub to go online."""
    import huggingface_hub

    real = huggingface_hub.snapshot_download

    def local_only(repo_id, **kwargs):
        assert kwargs.get("local_files_only"), f"a download of {repo_id} was attempted"
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local_only)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_hub_id_shape():
    assert is_hub_id("ibm-granite/granite-4.0-h-1b") and is_hub_id("nvidia/Nemotron-H-8B-Base-8K")
    for not_id in ("model", "/abs/path", "./rel/dir", "a/b/c", "a//b", "-a/b", "a/b.", "a--b/c",
                   "a/..", "~/x"):
        assert not is_hub_id(not_id), not_id


@pytest.mark.parametrize("cache_var", ["HF_HUB_CACHE", "HF_HOME"])
def test_cached_hub_id_loads_offline(tiny_granite, hub_env, monkeypatch, no_network, cache_var):
    hub_dir = hub_env / "hub"
    snapshot = fake_cache(hub_dir, tiny_granite)
    monkeypatch.setenv(cache_var, str(hub_dir if cache_var == "HF_HUB_CACHE" else hub_env))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO_ID) == snapshot
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(REPO_ID, max_num_seqs=2)
    assert llm.config.model == REPO_ID  # the id, not the snapshot path, names the model
    assert llm.model_path == snapshot
    got = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    ref = LLM(tiny_granite, max_num_seqs=2).generate(["hello"], params, use_tqdm=False)[0]
    assert got == ref.outputs[0].token_ids


def test_cached_hub_id_is_used_without_asking_the_hub(tiny_granite, hub_env, monkeypatch, no_network):
    # Not offline: a cached complete checkpoint is still taken from the cache.
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "hub"))
    snapshot = fake_cache(hub_env / "hub", tiny_granite)
    assert resolve_model(REPO_ID) == snapshot


def test_missing_hub_id_offline_says_so(hub_env, monkeypatch, no_network, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("acme/absent")
    msg = str(e.value)
    assert "'acme/absent' is not in the Hugging Face cache" in msg
    assert str(hub_env / "hub") in msg and "HF_HUB_OFFLINE" in msg
    # The command line prints it as an error, not a traceback.
    assert main(["generate", "--model", "acme/absent", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model 'acme/absent' is not in") and "Traceback" not in err


def test_incomplete_cached_snapshot_offline_says_so(tiny_granite, hub_env, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = fake_cache(hub_env / "hub", tiny_granite)
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="is incomplete in the Hugging Face cache"):
        resolve_model(REPO_ID)


def test_missing_hub_id_without_network_says_so(hub_env, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # A closed loopback port: the download fails at once, as with no network.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("acme/absent")
    msg = str(e.value)
    assert "'acme/absent' is not in the Hugging Face cache" in msg and "cannot be reached" in msg


def test_neither_a_path_nor_a_hub_id(hub_env, tmp_path):
    for bad in (str(tmp_path / "missing"), "./missing/dir", "a/b/c"):
        with pytest.raises(ModelNotFoundError, match="no such file or directory, and not a"):
            resolve_model(bad)
    with pytest.raises(ValueError, match="not a Hugging Face hub id"):
        LLM(str(tmp_path / "missing"))
