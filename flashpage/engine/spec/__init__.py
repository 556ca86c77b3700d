"""Speculative decoding: proposers (prompt lookup, a draft model, lookahead decoding, Medusa heads, an EAGLE
draft) whose tokens one target step verifies.

A proposer sets `seq.proposal` for decoding sequences before the step is scheduled; the scheduler computes those
tokens with the sequence's last one, and the engine keeps the verified prefix (engine/llm_engine.py)."""

from flashpage.engine.spec.config import SpeculativeConfig
from flashpage.engine.spec.ngram import NgramProposer, propose_ngram
from flashpage.engine.spec.stats import SpecStats


def target_feature_layers(spec: SpeculativeConfig | None, num_layers: int) -> tuple[int, ...]:
    """The target's layers at whose input a proposer reads the residual stream (`num_layers`: after the last):
    Medusa's heads and an EAGLE draft the last layer's output, an EAGLE-3 draft three layers' inputs."""
    if spec is None or spec.method not in ("medusa", "eagle", "eagle3"):
        return ()
    if spec.method == "eagle3":
        from flashpage.engine.spec.eagle3 import feature_layers
        return feature_layers(spec.model, num_layers)
    return (num_layers,)


def make_proposer(spec: SpeculativeConfig, cfg, runner, draft=None):
    """The proposer of `spec.method` for an engine with config `cfg`, target `runner` and (draft_model) the draft's
    loaded weights. A proposer's `propose(running)` sets `proposal` on the decoding sequences it can serve; `probs`
    is what the target's step needs of it (a draft's q rows, or None), and `release(seq_id)` forgets a sequence.
    One that learns from each step has `observe(seq, drawn, emitted, hidden)`: the tokens drawn at the sequence's
    sample rows, the rows whose tokens were emitted, and (`target_feature_layers`) the target's features at those
    rows. One that reads the target's features of every token has `take_features(plan, hidden)`."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "lookahead":
        from flashpage.engine.spec.lookahead import LookaheadProposer
        return LookaheadProposer(spec)
    if spec.method == "medusa":
        from flashpage.engine.spec.medusa import MedusaProposer
        return MedusaProposer(spec, runner)
    if spec.method in ("eagle", "eagle3"):
        from flashpage.engine.spec.eagle import EagleProposer
        return EagleProposer(spec, cfg, runner)
    from flashpage.engine.spec.draft import DraftProposer
    return DraftProposer(spec, cfg, runner, draft)


__all__ = ["NgramProposer", "SpecStats", "SpeculativeConfig", "make_proposer", "propose_ngram",
           "target_feature_layers"]
