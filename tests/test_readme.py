"""README lists exactly the parameters that exist: each list is compared with the code that defines it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from flashpage import SamplingParams
from flashpage.cli import build_parser
from flashpage.engine.config import EngineConfig
from flashpage.server.protocol import UNSERVED, ChatCompletionRequest, CompletionRequest, StreamOptions

README = (Path(__file__).parent.parent / "README.md").read_text()
ENGINE = {f.name for f in dataclasses.fields(EngineConfig)}


def section(start: str) -> str:
    """The README bullet or paragraph that begins with `start`, up to the next one."""
    i = README.index(start)
    return README[i:i + 1 + re.search(r"\n(- |\n)", README[i + 1:]).start()]


def names(text: str) -> set[str]:
    return set(re.findall(r"`([a-z][a-z_]*)`", text))


def options(text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]*", text))


def parser_options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def test_sampling_params_listed_exactly():
    listed, fields = names(section("- `SamplingParams`:")), {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields <= listed, fields - listed
    assert listed - fields <= ENGINE, listed - fields  # (the bullet may name the engine setting that bounds one)


def test_server_parameters_listed_exactly():
    listed = names(section("- Parameters:"))
    fields = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)) - {
        "model", "prompt", "messages", "stream", "stream_options"}  # (in the example and the routes bullet)
    assert fields <= listed, fields - listed
    response_keys = {"tokens", "token_logprobs", "text_offset"}
    assert listed - fields <= response_keys | set(UNSERVED), listed - fields - response_keys
    assert set(re.findall(r"`stream_options\.([a-z_]+)`", section("- Routes:"))) == set(StreamOptions.model_fields)


def test_cli_options_listed_exactly():
    _, subs = build_parser()
    listed = options(section("Options: every engine setting"))
    assert parser_options(subs["generate"]) == listed - {"--system"}
    assert parser_options(subs["chat"]) == listed
    engine = parser_options(subs["generate"]) - {"--max-tokens", "--temperature", "--top-p", "--top-k"}
    assert parser_options(subs["serve"]) - engine == options(section("flashpage serve --model")) - {"--model"}
