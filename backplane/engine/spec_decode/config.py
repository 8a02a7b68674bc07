"""The speculative-decoding configuration: which proposer, how many tokens, checked once.

``speculative_config`` reaches the engine as a mapping (a keyword of
``LLM`` / ``AsyncLLM`` / ``EngineConfig``, a YAML section, or the JSON of
``--speculative-config``, spelled as vLLM spells it) and becomes a
:class:`SpeculativeConfig` here, where every field is checked with an error
that names it and says what to give instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from backplane.core.errors import ConfigError

__all__ = ["METHODS", "MAX_SPECULATIVE_TOKENS", "SpeculativeConfig"]

#: the proposers a configuration may name
METHODS = ("ngram", "draft_model", "mtp")

#: more proposals than this per step cost more in verification than they can save
MAX_SPECULATIVE_TOKENS = 16

_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: the proposer and its settings.

    :param method: ``"ngram"`` (prompt lookup over the request's own tokens),
        ``"draft_model"`` (a smaller model sharing the vocabulary) or ``"mtp"``
        (the target model's own next-token-prediction layers).
    :param num_speculative_tokens: ``k``, the most tokens proposed per sequence and step.
    :param prompt_lookup_min: ``ngram`` only: the shortest n-gram matched.
    :param prompt_lookup_max: ``ngram`` only: the longest n-gram matched (tried first).
    :param model: ``draft_model`` only: the draft model's name or path.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig | None:
        """Build a checked configuration from what a user passed.

        :param value: ``None`` (no speculation), a :class:`SpeculativeConfig`, or a
            mapping with the keys of this class (``method`` and ``num_speculative_tokens``
            required).
        :return: the configuration, or ``None`` when ``value`` is ``None``.
        :raises ConfigError: on an unknown key, a missing or invalid field.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            if isinstance(value, SpeculativeConfig):
                value._check()
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"speculative_config must be a mapping such as "
                f'{{"method": "ngram", "num_speculative_tokens": 3}}, got {type(value).__name__}'
            )
        unknown = sorted(str(k) for k in value if k not in _FIELDS)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown key(s) {unknown}; the keys are {list(_FIELDS)}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ConfigError(
                    f"speculative_config needs {key!r} (method one of {list(METHODS)}, "
                    "num_speculative_tokens >= 1)"
                )
        kwargs: dict[str, Any] = dict(value)
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if key in kwargs:
                kwargs[key] = _as_int(key, kwargs[key])
        cfg = cls(**kwargs)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config method={self.method!r} is not known; use one of {list(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_config num_speculative_tokens={k}; give 1 to {MAX_SPECULATIVE_TOKENS}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo < 1 or hi < lo:
                raise ConfigError(
                    f"speculative_config prompt_lookup_min={lo}, prompt_lookup_max={hi}: "
                    "need 1 <= prompt_lookup_min <= prompt_lookup_max"
                )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(
                    "speculative_config method='draft_model' needs 'model': the draft "
                    "model's name or path (a smaller model with the target's vocabulary)"
                )
        elif self.model is not None:
            raise ConfigError(
                f"speculative_config 'model' is only read by method='draft_model', "
                f"not {self.method!r}; remove it"
            )

    def to_dict(self) -> dict[str, Any]:
        """The configuration as the mapping :meth:`from_value` takes (for YAML / JSON).

        :return: a plain dict.
        """
        return asdict(self)


def _as_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"speculative_config {key}={value!r} must be an integer, got {type(value).__name__}"
        )
    return int(value)
