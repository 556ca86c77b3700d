"""The LLM API and the CLI on the default model: outputs, chat, streaming, seeds, and bad input."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest

from flashpage import LLM, RequestOutput, SamplingParams, cli
from flashpage.tokenizer import IncrementalDetokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def test_chat_answers_paris(smollm_llm):
    out = smollm_llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None  # EOS, as vLLM reports it
    assert out.outputs[0].token_ids[-1] in smollm_llm.config.eos_token_ids


def test_generate_outputs_in_input_order_with_vllm_fields(smollm_llm):
    prompts = ["The capital of Italy is", {"prompt": "1, 2, 3, 4,"}, {"prompt_token_ids": [504, 3575, 282]}]
    outs = smollm_llm.generate(prompts, [GREEDY, SamplingParams(temperature=0, max_tokens=5), GREEDY], use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert outs[0].prompt == "The capital of Italy is" and outs[2].prompt is None
    assert outs[2].prompt_token_ids == [504, 3575, 282]
    assert len(outs[1].outputs[0].token_ids) == 5 and outs[1].outputs[0].finish_reason == "length"
    for prompt, out in zip(prompts, outs):  # each equals the same request run alone
        alone = smollm_llm.generate([prompt], out_params(out), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert out.outputs[0].text == smollm_llm.tokenizer.decode(out.outputs[0].token_ids)


def out_params(out):
    return SamplingParams(temperature=0, max_tokens=max(len(out.outputs[0].token_ids), 1))


def test_seeded_sampling_is_reproducible(smollm_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a = smollm_llm.generate("Tell me a story", sp, use_tqdm=False)[0].outputs[0].token_ids
    smollm_llm.generate("Unrelated request", SamplingParams(temperature=1.0, max_tokens=5), use_tqdm=False)
    b = smollm_llm.generate("Tell me a story", sp, use_tqdm=False)[0].outputs[0].token_ids
    c = smollm_llm.generate("Tell me a story", SamplingParams(**{**sp.__dict__, "seed": 99}), use_tqdm=False)[0]
    assert a == b and a != c.outputs[0].token_ids


def test_min_tokens_and_stop_token_ids(smollm_llm):
    ids = smollm_llm.chat_prompt_ids([{"role": "user", "content": "Say yes."}])
    out = smollm_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=30, min_tokens=12),
                              use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 12
    first = smollm_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stopped = smollm_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                  stop_token_ids=[first[1]]), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == first[:2] and stopped.finish_reason == "stop" and stopped.stop_reason == first[1]
    # the stop token's text is left out of the output, as vLLM does (its id stays in token_ids)
    assert stopped.text == smollm_llm.tokenizer.decode(first[:1])
    tok = smollm_llm.tokenizer
    eos = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    capital = smollm_llm.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}])
    ended = smollm_llm.generate({"prompt_token_ids": capital}, eos, use_tqdm=False)[0].outputs[0]
    assert ended.finish_reason == "stop" and ended.token_ids[-1] in smollm_llm.config.eos_token_ids
    assert ended.text == tok.decode(ended.token_ids[:-1], skip_special_tokens=False)


def test_context_limit_and_bad_prompts(smollm_gguf):
    llm = LLM(str(smollm_gguf), dtype="float32", device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="prompt has 40 tokens.*max_model_len=32"):
        llm.generate({"prompt_token_ids": [1] * 40})
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.generate({"prompt_token_ids": [1, 49152]})
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    # max_tokens past the context is refused with the numbers, not clamped; max_tokens=None runs to the context
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) plus max_tokens \(3\) is 33 tokens.*max_model_len=32"):
        llm.generate({"prompt_token_ids": [504] * 30}, SamplingParams(max_tokens=3, ignore_eos=True))
    out = llm.generate({"prompt_token_ids": [504] * 30}, SamplingParams(temperature=0, max_tokens=None,
                                                                        ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].outputs[0].finish_reason == "length"
    assert llm.generate({"prompt_token_ids": [504] * 30}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len must be in"):
        LLM(str(smollm_gguf), device="cpu", max_model_len=10**6)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("min_p", 2.0), ("max_tokens", 0), ("min_tokens", -1), ("seed", 1.5),
                                         ("stop_token_ids", [-1]), ("temperature", float("inf")),
                                         ("temperature", float("nan")), ("repetition_penalty", float("inf")),
                                         ("top_p", float("nan")), ("min_p", float("nan")),
                                         ("presence_penalty", float("nan")), ("frequency_penalty", float("-inf")),
                                         ("stop", 5), ("stop", [""]), ("stop_token_ids", 5)])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_incremental_detokenizer_multibyte(smollm_llm):
    tok = smollm_llm.tokenizer
    for text in ["héllo wörld, 世界! 🙂🙂 naïve café", " leading space and\nnewline", "数字 12345"]:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [])
        pieces = [detok.step(t) for t in ids]
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)


def test_stream_equals_generate(smollm_llm):
    prompt = "Write one sentence about the sea:"
    text = "".join(smollm_llm.stream(prompt, GREEDY))
    assert text == smollm_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text


def test_cli_chat_streams_answer(smollm_llm, monkeypatch, capsys):
    monkeypatch.setattr("flashpage.LLM", lambda *a, **k: smollm_llm)  # reuse the session's model
    assert cli.main(["chat", "What is the capital of France?", "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_errors_are_one_line_not_tracebacks():
    r = subprocess.run([sys.executable, "-m", "flashpage", "generate", "hi", "--model", "no-such-model"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("flashpage: error: unknown model") and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "flashpage", "generate", "hi", "--temperature", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "SamplingParams.temperature" in r.stderr and "Traceback" not in r.stderr


def test_engine_settings_are_declared_once_and_checked():
    """LLM, the CLI and the server take exactly EngineConfig's fields; bad ones fail before any model loads."""
    import argparse
    import dataclasses

    from flashpage.engine.config import EngineConfig

    with pytest.raises(ValueError, match="unknown engine setting.*'attention_backend'"):
        LLM("no-such-model", attention_backend="torch")
    for name, value in [("max_num_seqs", 0), ("block_size", 12), ("max_num_seqs", "8"), ("kernels", "cuda"),
                        ("gpu_memory_utilization", 1.5), ("enable_prefix_caching", "yes"), ("max_model_len", 2.5)]:
        with pytest.raises(ValueError, match=name) as e:
            LLM("no-such-model", **{name: value})
        assert e.value.param == name
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager", "--seed", "3"])
    cfg = EngineConfig.from_cli(args)
    assert dataclasses.asdict(cfg) == {**dataclasses.asdict(EngineConfig()), "max_num_seqs": 8,
                                       "enable_prefix_caching": False, "enforce_eager": True, "seed": 3}
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for f in dataclasses.fields(EngineConfig):  # README lists every setting, as a parameter and as an option
        assert f"`{f.name}`" in readme and f"--{f.name.replace('_', '-')}" in readme, f.name


def test_bad_batches_name_the_prompt_and_chat_outputs_carry_their_prompt(smollm_llm):
    with pytest.raises(ValueError, match="prompts must be") as e:
        smollm_llm.generate(None)
    assert e.value.param == "prompts"
    with pytest.raises(ValueError, match=r"prompt 2: prompt token ids must be integers"):
        smollm_llm.generate(["a", "b", {"prompt_token_ids": [1, 10**6]}], use_tqdm=False)
    assert smollm_llm.stats()["num_waiting"] == smollm_llm.stats()["num_running"] == 0  # nothing was admitted
    messages = [{"role": "user", "content": "Hi"}]
    out = smollm_llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == smollm_llm.tokenizer.apply_chat_template(messages, True)
    assert out.prompt_token_ids == smollm_llm.chat_prompt_ids(messages)


def test_bench_without_triton_is_one_line_not_a_traceback():
    code = "import sys; sys.modules['triton'] = None; from flashpage import cli; sys.exit(cli.main(['bench', 'kernels', '--help']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "needs the package 'triton'" in r.stderr and "Traceback" not in r.stderr


def test_request_metrics_are_in_order(smollm_llm):
    import time

    start = time.time()
    out = smollm_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    m = out.metrics
    assert start <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time <= time.time() and m.time_in_queue >= 0


def test_vllm_sampling_extras(smollm_llm):
    """include_stop_str_in_output, detokenize, bad_words, allowed_token_ids, logit_bias, logprobs=-1."""
    from conftest import engine_from

    tok = smollm_llm.tokenizer
    ids = smollm_llm.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}])
    run = lambda **kw: smollm_llm.generate({"prompt_token_ids": ids}, SamplingParams(**{  # noqa: E731
        "temperature": 0, "max_tokens": 12, **kw}), use_tqdm=False)[0].outputs[0]
    base = run()
    assert base.text.startswith("The capital of France is Paris")
    at = base.text.index("France")
    assert run(stop=["France"]).text == base.text[:at]
    assert run(stop=["France"], include_stop_str_in_output=True).text == base.text[:at + len("France")]
    assert run(stop_token_ids=[base.token_ids[2]], include_stop_str_in_output=True).text == tok.decode(base.token_ids[:3])
    plain = run(detokenize=False)
    assert plain.text == "" and plain.token_ids == base.token_ids
    banned = run(bad_words=["Paris"])
    assert "Paris" not in banned.text and banned.text.startswith("The capital of France is")
    forced = run(logit_bias={base.token_ids[0]: 100.0}, max_tokens=4)  # a +100 bias wins every greedy step
    assert forced.token_ids == [base.token_ids[0]] * 4
    allowed = [base.token_ids[3], base.token_ids[5], 42]
    sampled = run(temperature=1.0, seed=3, allowed_token_ids=allowed, max_tokens=20, logprobs=0)
    assert set(sampled.token_ids) <= set(allowed)
    # log-probs stay those of the model's own distribution, not of the restricted one
    assert sum(math.exp(e[t].logprob) for e, t in zip(sampled.logprobs, sampled.token_ids)) < len(sampled.token_ids)
    for name, params in [("logit_bias", dict(logit_bias={49152: 1.0})), ("allowed_token_ids", dict(allowed_token_ids=[10**6])),
                         ("logprobs", dict(logprobs=-1)), ("logprobs", dict(logprobs=21))]:
        with pytest.raises(ValueError, match=name) as e:
            run(**params)
        assert e.value.param == name
    everything = engine_from(smollm_llm, max_logprobs=-1)
    everything.add_request("all", ids, SamplingParams(temperature=0, max_tokens=1, logprobs=-1))
    out = None
    while everything.has_unfinished_requests():
        outs = everything.step()
        out = outs[0] if outs else out
    entry = out.outputs[0].logprobs[0]
    assert len(entry) == 49152 and sorted(lp.rank for lp in entry.values()) == list(range(1, 49153))
    assert abs(sum(math.exp(lp.logprob) for lp in entry.values()) - 1) < 1e-4


def test_chat_template_continuation_and_variables_and_their_errors(smollm_llm):
    tok = copy.copy(smollm_llm.tokenizer)
    tok.chat_template = "{{ greeting }}{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " Once upon "}]
    assert tok.apply_chat_template(chat, False, chat_template_kwargs={"greeting": "Hello"}) == "Hello[hi][Once upon]"
    # the final message as given does not appear (the template trims it), the stripped one does
    assert tok.apply_chat_template(chat, False, continue_final_message=True) == "[hi][Once upon"
    with pytest.raises(ValueError, match="cannot both be set"):
        tok.apply_chat_template(chat, True, continue_final_message=True)
    with pytest.raises(ValueError, match="a final message with text"):
        tok.apply_chat_template(chat[:1] + [{"role": "assistant", "content": " "}], False, continue_final_message=True)
    with pytest.raises(ValueError, match=r"cannot set \['add_generation_prompt'\]"):
        tok.apply_chat_template(chat, False, chat_template_kwargs={"add_generation_prompt": True})
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render the final message"):
        tok.apply_chat_template(chat, False, continue_final_message=True)
