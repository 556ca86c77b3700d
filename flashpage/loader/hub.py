"""Model ids on the Hugging Face Hub ("org/name"), resolved by `huggingface_hub` into its cache.

The usual environment applies: HF_HOME / HF_HUB_CACHE (where), HF_TOKEN (gated and private models),
HF_HUB_OFFLINE (the cache alone). Only the files flashpage reads are fetched (config, safetensors weights,
tokenizer and chat template; just one file of a GGUF repo), with huggingface_hub's progress bars.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.json", "chat_template.jinja"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]


def is_hub_id(model: str) -> bool:
    return bool(HUB_ID.match(model)) and not model.endswith(".gguf")


def resolve_hub_model(repo_id: str, *, revision: str | None = None, gguf_file: str | None = None,
                      weights: bool = True, extra_patterns: list[str] = ()) -> Path:
    """The local snapshot directory of `repo_id` (or its `gguf_file`), downloading what is missing. `weights=False`
    fetches the configuration and tokenizer alone (random weights of the model's shape); `extra_patterns`, files
    beyond the usual (Medusa heads' `.pt`). Raises ValueError naming the id and what is missing."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    offline = constants.HF_HUB_OFFLINE
    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        if gguf_file:
            return Path(huggingface_hub.hf_hub_download(repo_id, gguf_file, revision=revision,
                                                        local_files_only=offline))
        path = Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, local_files_only=offline,
            allow_patterns=CONFIG_FILES + (WEIGHT_FILES if weights else []) + list(extra_patterns)))
    except errors.GatedRepoError:
        raise ValueError(f"model {repo_id} is gated on the Hugging Face Hub: accept its terms on its page, then set "
                         f"HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"no model {repo_id} on the Hugging Face Hub (or it is private: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"model {repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:  # (before EntryNotFoundError)
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub could not be reached ({type(e).__name__})"
        raise ValueError(f"model {where}{f' file {gguf_file!r}' if gguf_file else ''} is not in the Hugging Face "
                         f"cache ({constants.HF_HUB_CACHE}) and {why}") from None
    except errors.EntryNotFoundError:
        raise ValueError(f"model {where} has no file {gguf_file!r} on the Hugging Face Hub") from None
    except OSError as e:  # no network
        raise ValueError(f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub "
                         f"could not be reached ({type(e).__name__}: {e})") from None
    if not (path / "config.json").exists():
        raise ValueError(f"model {where} on the Hugging Face Hub has no config.json: not a transformers model "
                         f"(a GGUF repo needs gguf_file)")
    return path
