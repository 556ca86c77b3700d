"""Skeleton-of-thought (`LLM.skeleton_of_thought`): the skeleton's points parsed, every point expanded in one batch
whose prompts share the question's and skeleton's blocks, the answer joined in order; bad input named."""

from __future__ import annotations

import pytest

from flashpage import SamplingParams
from flashpage.engine import skeleton
from flashpage.engine.skeleton import parse_skeleton


def test_parse_skeleton_reads_numbered_points_in_order():
    assert parse_skeleton(" Sleep well\n2. Exercise\n3.  Talk to friends \nThat is all.", 10) == \
        ["Sleep well", "Exercise", "Talk to friends"]
    assert parse_skeleton(" A\n2. B\n4. D", 10) == ["A", "B"]  # up to the first gap
    assert parse_skeleton(" A\n2. B\n3. C", 2) == ["A", "B"]
    assert parse_skeleton("\n\nno list here", 10) == []
    assert parse_skeleton(" Syntax: Python 3.12 is terse. 2. Types: dynamic in both.", 10) == \
        ["Syntax: Python 3.12 is terse.", "Types: dynamic in both."]  # points one after another on a line


def test_skeleton_of_thought_expands_points_in_one_shared_batch(smollm_llm):
    llm = smollm_llm
    before = llm.stats()
    out = llm.skeleton_of_thought("What are the most effective ways to deal with stress?")
    after = llm.stats()
    assert 1 <= len(out.points) <= 10 and len(out.point_outputs) == len(out.expansions) == len(out.points)
    lines = out.text.split("\n")
    assert [line.split(". ", 1)[0] for line in lines] == [str(i) for i in range(1, len(out.points) + 1)]
    assert all(line.split(". ", 1)[1].startswith(p) for line, p in zip(lines, out.points))
    # the expansions' prompts share the question and the skeleton: most of their tokens come from the prefix cache
    prompt_tokens = sum(len(o.prompt_token_ids) for o in out.point_outputs)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] > 0.5 * prompt_tokens
    assert after["kv_blocks_free"] == after["kv_blocks_total"]  # nothing held after the answer
    print(out.text, f"\nskeleton {out.skeleton_s:.2f} s, expansion {out.expand_s:.2f} s")


def test_skeleton_of_thought_bad_input(smollm_llm, monkeypatch):
    with pytest.raises(ValueError, match="non-empty question"):
        smollm_llm.skeleton_of_thought("  ")
    with pytest.raises(ValueError, match="max_points must be at least 1"):
        smollm_llm.skeleton_of_thought("Why?", max_points=0)
    monkeypatch.setattr(skeleton, "parse_skeleton", lambda text, max_points: [])  # a model that writes no list
    with pytest.raises(ValueError, match="no numbered skeleton"):
        smollm_llm.skeleton_of_thought("Why is the sky blue?", SamplingParams(temperature=0, max_tokens=5))
    assert smollm_llm.stats()["kv_blocks_free"] == smollm_llm.stats()["kv_blocks_total"]
