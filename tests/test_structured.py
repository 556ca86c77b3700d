"""Structured outputs on SmolLM2: every constrained output parses and validates, in batches mixed with free
requests, with n > 1, stop strings, streaming, speculation and the server's response_format and guided_* fields."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from conftest import engine_from
from flashpage import SamplingParams
from flashpage.engine.structured import StructuredOutputs
from flashpage.sampling_params import StructuredOutputsParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "languages": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "maxItems": 3}}}
GBNF = 'root ::= "The answer is " ("yes" | "no") "."'


def constrained(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def check(text: str, so: StructuredOutputsParams) -> None:
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.json_object:
        assert isinstance(json.loads(text), dict)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(r"The answer is (yes|no)\.", text), text


def test_a_batch_mixing_constrained_and_free_requests(smollm_llm):
    kinds = [constrained(json=PERSON), constrained(json_object=True, disable_any_whitespace=True),
             constrained(regex=r"[A-Z][a-z]+, [0-9]{4}"), constrained(choice=["positive", "negative", "neutral"]),
             constrained(grammar=GBNF)]
    prompts, params = [], []
    for i, so in enumerate(kinds):
        prompts += [f"Question {i}: describe a programmer as JSON.", "Tell me about the sea."]
        params += [SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=120, structured_outputs=so),
                   SamplingParams(temperature=0.9, seed=i, max_tokens=12, ignore_eos=True)]
    params[2] = SamplingParams(temperature=0, max_tokens=120, guided_decoding=kinds[1])  # the older name
    outs = smollm_llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if i % 2:  # free requests are untouched: as long as asked
            assert len(out.outputs[0].token_ids) == 12
            continue
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            check(c.text, kinds[i // 2])
    assert not re.search(r'[{,:\[]\s|\s[}\],:]', outs[2].outputs[0].text)  # no whitespace between JSON tokens
    # the free requests are the tokens they are alone
    alone = smollm_llm.generate(prompts[1], params[1], use_tqdm=False)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == alone


def test_stop_strings_and_max_tokens_cut_a_constrained_output(smollm_llm):
    so = constrained(regex=r"(ab)+c")
    stopped = smollm_llm.generate("Repeat: ababab", SamplingParams(temperature=0, max_tokens=30, stop=["bab"],
                                                                    structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert stopped.text == "a" and stopped.stop_reason == "bab" and stopped.finish_reason == "stop"
    short = smollm_llm.generate("Repeat: ababab", SamplingParams(temperature=0, max_tokens=2, structured_outputs=so),
                                use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "length" and re.fullmatch(r"(ab|a|b)+", short.text)


def test_speculation_keeps_a_constrained_greedy_output(smollm_llm):
    """Prompt lookup proposes tokens the grammar may refuse: they are cut, and the output is what plain decoding
    gives (greedy), for constrained and free requests alike."""
    prompt = 'Copy this JSON: {"name": "Ada", "age": 36, "languages": ["python", "c"]}. Copy: '
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=constrained(json=PERSON)),
              SamplingParams(temperature=0, max_tokens=20)]
    want = [o.outputs[0].token_ids for o in smollm_llm.generate([prompt, prompt], params, use_tqdm=False)]
    engine = engine_from(smollm_llm, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    for i, p in enumerate(params):
        engine.add_request(str(i), smollm_llm.tokenizer.encode(prompt), p)
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o.outputs[0].token_ids
    assert [got["0"], got["1"]] == want
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    jsonschema.validate(json.loads(smollm_llm.tokenizer.decode(want[0])), PERSON)


@pytest.mark.parametrize("bad", [{"json": "{not json"}, {"regex": "([a-"}, {"grammar": "root ::= missing"},
                                 {"json": {"type": "object"}, "regex": "a"}, {}, {"choice": []}, {"shape": "x"}])
def test_bad_constraints_are_refused_naming_the_field(smollm_llm, bad):
    engine = smollm_llm.engine
    with pytest.raises(ValueError) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=bad))
    assert getattr(e.value, "param", None) == "structured_outputs", e.value
    assert "bad" not in engine.requests and not engine.has_unfinished_requests()


def test_a_model_without_a_tokenizer_refuses_structured_outputs():
    with pytest.raises(ValueError, match="tokenizer"):
        StructuredOutputs(None, 100, [0]).matcher(constrained(choice=["a"]))


def test_server_response_format_and_guided_fields(smollm_llm):
    from test_server import KEY, MODEL, RunningServer

    from flashpage.server.app import build_app
    from flashpage.server.async_engine import AsyncEngine

    engine = AsyncEngine(engine_from(smollm_llm), max_waiting=16)
    server = RunningServer(build_app(engine, smollm_llm.tokenizer, MODEL, api_key=KEY))
    try:
        from openai import OpenAI

        c = OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
        messages = [{"role": "user", "content": "Describe a programmer as JSON."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        chat = c.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=120, n=2,
                                         temperature=0.8, seed=3)
        for choice in chat.choices:
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL, messages=messages, response_format=fmt, max_tokens=120, stream=True, temperature=0))
        jsonschema.validate(json.loads(streamed), PERSON)
        obj = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with one "
                                        "key."}], response_format={"type": "json_object"}, max_tokens=60, temperature=0,
                                        extra_body={"repetition_penalty": 1.3})
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        choice = c.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                      extra_body={"guided_choice": ["blue", "green"]}).choices[0].text
        regex = c.completions.create(model=MODEL, prompt="Year:", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}).choices[0].text
        grammar = c.completions.create(model=MODEL, prompt="Well?", max_tokens=20, temperature=0,
                                       extra_body={"guided_grammar": GBNF}).choices[0].text
        assert choice in ("blue", "green") and re.fullmatch("[0-9]{4}", regex) and grammar.startswith("The answer is ")
        post = lambda body: httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", **body},  # noqa: E731
                                       headers={"Authorization": f"Bearer {KEY}"})
        for body, param in [({"guided_regex": "([a-"}, "structured_outputs"),
                            ({"structured_outputs": {"shape": "x"}}, "structured_outputs"),
                            ({"response_format": {"type": "xml"}}, "response_format"),
                            ({"response_format": {"type": "json_schema"}}, "response_format"),
                            ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json")]:
            r = post(body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert post({"max_tokens": 2}).status_code == 200  # the engine goes on
    finally:
        server.stop()
        engine.shutdown()
