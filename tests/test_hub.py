"""Model ids from the Hugging Face Hub, through huggingface_hub's real code path against a cache the test writes
(there is no Hub on these machines): HF_HUB_CACHE and HF_HUB_OFFLINE as a user sets them."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import gguf
import pytest

from flashpage import LLM, SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_cache(cache, repo_id: str, source_dir, revision: str = "main", only=None) -> None:
    """The layout huggingface_hub's downloads leave: models--org--name/{refs/<revision>, snapshots/<commit>/...}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in source_dir.iterdir():
        if only is None or f.name in only:
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(COMMIT)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # (read at import from HF_HUB_CACHE / HF_HOME)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_from_the_cache_and_serves_token_ids_without_a_tokenizer(hub_cache, tiny_checkpoints):
    path, _ = tiny_checkpoints["llama3-rope-scaling"]
    write_cache(hub_cache, "test-org/tiny-llama", path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 99, 3]}
    from_hub = LLM("test-org/tiny-llama", device="cpu").generate(prompt, params, use_tqdm=False)
    from_dir = LLM(str(path), device="cpu").generate(prompt, params, use_tqdm=False)
    assert from_hub[0].outputs[0].token_ids == from_dir[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="needs a tokenizer|no tokenizer"):
        LLM("test-org/tiny-llama", device="cpu").generate("text", params, use_tqdm=False)


def test_dummy_weights_of_a_hub_model_need_only_its_config(hub_cache, tiny_checkpoints):
    path, model = tiny_checkpoints["llama-tied"]
    write_cache(hub_cache, "test-org/config-only", path, only={"config.json"})
    llm = LLM("test-org/config-only", load_format="dummy", device="cpu")
    assert llm.config.num_key_value_heads == model.config.num_key_value_heads and llm.config.tie_word_embeddings
    with pytest.raises(ValueError, match="safetensors"):
        LLM("test-org/config-only", device="cpu")  # real weights: none in the cache


def test_revisions_and_gguf_files_of_hub_repos(hub_cache, tiny_checkpoints, tmp_path):
    from gguf_factory import write_gguf

    path, model = tiny_checkpoints["llama3-rope-scaling"]
    write_cache(hub_cache, "test-org/tiny-llama", path, revision="v2")
    assert LLM("test-org/tiny-llama", revision="v2", device="cpu").config.vocab_size == 384
    with pytest.raises(ValueError, match=r"model test-org/tiny-llama at revision 'v3' is not in the Hugging Face "
                                         r"cache .* and HF_HUB_OFFLINE is set"):
        LLM("test-org/tiny-llama", revision="v3", device="cpu")
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(gguf_dir / "tiny-f32.gguf", model, [gguf.GGMLQuantizationType.F32])
    write_cache(hub_cache, "test-org/tiny-GGUF", gguf_dir)
    llm = LLM("test-org/tiny-GGUF", gguf_file="tiny-f32.gguf", device="cpu")
    assert llm.config.num_hidden_layers == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="has no config.json: not a transformers model .*gguf_file"):
        LLM("test-org/tiny-GGUF", device="cpu")
    with pytest.raises(ValueError, match="name a version or file of a Hugging Face Hub model"):
        LLM(str(path), revision="v2", device="cpu")


def test_hub_errors_name_the_id_and_what_is_missing(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    with pytest.raises(ValueError, match="model nobody/nothing is not in the Hugging Face cache"):
        LLM("nobody/nothing", device="cpu")

    response = SimpleNamespace(headers={}, status_code=403, request=None)  # what the Hub's error carries

    def refuse(error):
        def download(*args, **kwargs):
            raise error("refused for the test", response=response) if error is not OSError else error("network down")
        return download

    for error, message in [(errors.GatedRepoError, "model org/gated is gated .* set HF_TOKEN"),
                           (errors.RepositoryNotFoundError, "no model org/gated on the Hugging Face Hub"),
                           (errors.RevisionNotFoundError, "has no revision 'v9'"),
                           (OSError, "could not be reached")]:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse(error))
        with pytest.raises(ValueError, match=message):
            LLM("org/gated", revision="v9" if error is errors.RevisionNotFoundError else None, device="cpu")
