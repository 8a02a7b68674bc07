"""Which proposer a speculative configuration gets, and whether the model can speculate."""

from __future__ import annotations

from typing import Any

from backplane.core.errors import ConfigError
from backplane.engine.spec_decode.config import SpeculativeConfig
from backplane.engine.spec_decode.ngram import NgramProposer
from backplane.engine.spec_decode.proposer import Proposer

__all__ = ["check_parallel", "check_target", "create_proposer"]


def check_parallel(config: SpeculativeConfig, tensor_parallel_size: int) -> None:
    """Refuse a method that cannot speculate for a target split over ranks.

    Every rank verifies (the LM head and the recurrent state copies run on all of
    them); prompt lookup drafts on the host and a draft model runs whole on the
    driver, but the MTP layers belong to the split target and would have to run
    on every rank.

    :param config: the speculative configuration.
    :param tensor_parallel_size: ranks the target is split over.
    :raises ConfigError: saying what is unsupported and what to do.
    """
    if tensor_parallel_size > 1 and config.method == "mtp":
        raise ConfigError(
            f"speculative_config method='mtp' is not supported with "
            f"tensor_parallel_size={tensor_parallel_size} yet (the MTP layers are split with "
            "the model and would draft on one rank only); use method='ngram' or "
            "'draft_model', or tensor_parallel_size=1"
        )


def check_target(
    config: SpeculativeConfig, *, model: str, recurrent: bool, tensor_parallel_size: int
) -> None:
    """Refuse targets speculative verification does not handle yet.

    :param config: the speculative configuration.
    :param model: the target model's name (for the message).
    :param recurrent: the model has recurrent state (Mamba2 / delta-rule layers; supported).
    :param tensor_parallel_size: ranks the target is split over.
    :raises ConfigError: saying what is unsupported and what to do.
    """
    # A recurrent target (Mamba2 / delta-rule layers) verifies too: its ops keep the state
    # after every chunk position and the accepted one is kept (SpecDecoder.mark_verification).
    check_parallel(config, tensor_parallel_size)


def create_proposer(
    config: SpeculativeConfig,
    *,
    target: Any = None,
    backends: dict[str, Any] | None = None,
    max_num_seqs: int = 1,
    max_model_len: int = 0,
    cuda_graphs: bool = False,
) -> Proposer:
    """Build the proposer of a configuration.

    :param config: the speculative configuration.
    :param target: the target model (``draft_model``: its dtype, device and
        vocabulary; ``mtp``: its MTP layers, loaded with it).
    :param backends: ``{family: backend object}`` the draft model or MTP layers run on.
    :param max_num_seqs: the most sequences a model-running proposer drafts for at once.
    :param max_model_len: the longest sequence.
    :param cuda_graphs: a model-running proposer replays its drafting steps from graphs
        captured now (the worker's decode graphs are on).
    :return: the proposer.
    :raises ConfigError: for a method whose proposer is not available.
    """
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method in ("draft_model", "mtp") and target is not None and backends is not None:
        limits = {
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len or target.max_model_len,
            "cuda_graphs": cuda_graphs,
        }
        if config.method == "draft_model":
            from backplane.engine.spec_decode.draft import load_draft_proposer

            return load_draft_proposer(config, target=target, backends=backends, **limits)
        from backplane.engine.spec_decode.mtp import MTPProposer

        return MTPProposer(
            target, backends, num_speculative_tokens=config.num_speculative_tokens, **limits
        )
    raise ConfigError(
        f"speculative_config method={config.method!r} has no proposer in this engine yet; "
        "use method='ngram'"
    )
