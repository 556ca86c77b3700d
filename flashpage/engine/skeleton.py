"""Skeleton-of-thought (Ning et al., 2023): prompt-based parallel decoding. The model first writes a short skeleton
of its answer (numbered points of a few words), then every point is expanded at once, as one batch whose prompts
share the question and the skeleton (their KV blocks are shared through the prefix cache), and the expansions are
joined in order. Fewer sequential decode steps than one long answer, at the price of a second prefill and of
points written without seeing each other.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

from flashpage.outputs import RequestOutput
from flashpage.sampling_params import SamplingParams

# The paper's two prompts (its appendix), lightly shortened.
SKELETON_PROMPT = (
    "You're an organizer responsible for only giving the skeleton (not the full content) for answering the question. "
    "Provide the skeleton in a list of points (numbered 1., 2., 3., etc.) to answer the question. Instead of writing "
    "a full sentence, each skeleton point should be very short with only 3~5 words. Generally, the skeleton should "
    "have 3~10 points.\n\nQuestion:\n{question}\nSkeleton:"
)
POINT_PROMPT = (
    "You're responsible for continuing the writing of one and only one point in the overall answer to the following "
    "question.\n\n{question}\n\nThe skeleton of the answer is\n\n{skeleton}\n\nContinue and only continue the writing "
    "of point {index}. Write it **very shortly** in 1~2 sentences and do not continue with other points!"
)
_MARK = re.compile(r"(?<!\S)(\d+)\.[ \t]+")  # "N. " where a point begins: a line's start, or inline after a space


@dataclass
class SkeletonOfThoughtOutput:
    question: str
    text: str  # the joined answer: "1. <point>: <expansion>" per line
    points: list[str]  # the skeleton's points
    expansions: list[str]  # each point's expansion, in order
    skeleton_output: RequestOutput
    point_outputs: list[RequestOutput]
    skeleton_s: float  # wall time of the skeleton stage
    expand_s: float  # wall time of the (parallel) expansion stage


def parse_skeleton(text: str, max_points: int) -> list[str]:
    """The numbered points of a skeleton (the text after the prompt's "1."): "N. ..." on lines of their own or one
    after another on a line, each to the next point or the end of its line, in order up to the first gap in the
    numbering."""
    text = "1." + text
    marks = list(_MARK.finditer(text))
    points = []
    for mark, after in zip(marks, marks[1:] + [None]):
        point = text[mark.end():after.start() if after else len(text)].split("\n", 1)[0].strip()
        if int(mark.group(1)) != len(points) + 1 or len(points) == max_points or not point:
            break
        points.append(point)
    return points


def skeleton_of_thought(llm, question: str, sampling_params: SamplingParams | None = None, *, max_points: int = 10,
                        skeleton_max_tokens: int = 200, use_tqdm: bool = False) -> SkeletonOfThoughtOutput:
    """Answer `question` (a user message, through the chat template) by skeleton-of-thought. `sampling_params`
    drive each point's expansion (default: greedy, 128 tokens, ending at a line break), which also ends where the
    next point's number begins (small models tend to go on with the list); the skeleton is drawn with the same
    parameters but `skeleton_max_tokens` and no stop strings."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("skeleton_of_thought needs a non-empty question (a string)")
    if max_points < 1:
        raise ValueError(f"max_points must be at least 1, got {max_points}")
    params = sampling_params or SamplingParams(temperature=0, max_tokens=128, stop=["\n"])
    tok = llm._require_tokenizer()

    def prompt(user: str, answer_start: str) -> dict:
        text = tok.apply_chat_template([{"role": "user", "content": user}], True) + answer_start
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    start = time.perf_counter()
    skeleton_params = dataclasses.replace(params, max_tokens=skeleton_max_tokens, stop=[], n=1)
    skeleton_out = llm.generate(prompt(SKELETON_PROMPT.format(question=question), "1."), skeleton_params,
                                use_tqdm=use_tqdm)[0]
    points = parse_skeleton(skeleton_out.outputs[0].text, max_points)
    skeleton_s = time.perf_counter() - start
    if not points:
        raise ValueError(f"the model wrote no numbered skeleton for this question: {skeleton_out.outputs[0].text!r}")
    skeleton = "\n".join(f"{i}. {p}" for i, p in enumerate(points, 1))
    start = time.perf_counter()
    point_outs = llm.generate([prompt(POINT_PROMPT.format(question=question, skeleton=skeleton, index=i),
                                      f"{i}. {p}:") for i, p in enumerate(points, 1)],
                              [dataclasses.replace(params, stop=[*(params.stop or []), f"{i + 1}."], n=1)
                               for i in range(1, len(points) + 1)], use_tqdm=use_tqdm)
    expand_s = time.perf_counter() - start
    expansions = [o.outputs[0].text.strip() for o in point_outs]
    text = "\n".join(f"{i}. {p}: {e}" if e else f"{i}. {p}" for i, (p, e) in enumerate(zip(points, expansions), 1))
    return SkeletonOfThoughtOutput(question, text, points, expansions, skeleton_out, point_outs, skeleton_s, expand_s)
