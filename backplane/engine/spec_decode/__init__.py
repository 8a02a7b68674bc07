"""Speculative decoding: configuration, the proposer interface and the proposers."""

from backplane.engine.spec_decode.config import METHODS, SpeculativeConfig
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest, Proposer

__all__ = ["METHODS", "ProposalContext", "ProposalRequest", "Proposer", "SpeculativeConfig"]
