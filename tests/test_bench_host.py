"""`flashpage bench host` (the engine's host work per step, the model left out) runs and reports its parts."""

from __future__ import annotations

import json

from flashpage.bench import host


def test_bench_host_times_every_part_of_a_decode_step(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host.main(["--num-seqs", "5", "--input-len", "40", "--steps", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decoding"] == 5  # every sequence decodes in the timed steps
    # each step's parts lie inside it (medians do not add up: the parts' medians may come from different steps)
    steps = result["per_step_ms"]
    assert len(steps["step"]) == 3
    for i, total in enumerate(steps["step"]):
        assert 0 < steps["schedule"][i] + steps["launch"][i] + steps["read_back"][i] <= total
    assert "host work per decode step of 5 sequences" in capsys.readouterr().out
