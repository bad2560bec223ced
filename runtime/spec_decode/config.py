"""``speculative_config`` (vLLM's keys): method, model, num_speculative_tokens, prompt_lookup_*.

Methods: ``ngram`` (prompt lookup), ``draft_model`` (a small model of the same vocabulary),
``medusa`` (heads on the target's final hidden state), ``eagle`` / ``eagle3`` (a one-layer draft
fed by the target's features, spec_decode/eagle.py), ``mtp`` (the target checkpoint's own
multi-token prediction layer, DeepSeek-V3's ``num_nextn_predict_layers``: spec_decode/mtp.py;
``model`` is optional, by default the target's directory). vLLM's older name ``deepseek_mtp`` is
accepted as ``mtp``.

Medusa, EAGLE and MTP also take a candidate tree, ``speculative_token_tree`` (vLLM's key: a list of rank paths,
or its Python literal string such as ``"[(0,), (1,), (0, 0)]"``; runtime/spec_decode/medusa_tree.py),
and non-greedy requests may use Medusa's typical acceptance instead of rejection sampling
(``acceptance_method: "typical_acceptance_sampler"`` with ``posterior_threshold`` and
``posterior_alpha``, the names of vLLM's typical acceptance sampler; runtime/spec_decode/typical.py).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.options import json_object

METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")
NOT_YET: tuple[str, ...] = ()
ALIASES = {"deepseek_mtp": "mtp"}
# Methods whose `model` is a directory of their own (a draft model or heads).
WITH_MODEL = ("draft_model", "medusa", "eagle", "eagle3")
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "speculative_token_tree", "acceptance_method", "posterior_threshold", "posterior_alpha"}
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")
# Methods that propose more than one guess per position (a candidate tree).
TREE_METHODS = ("medusa", "eagle", "eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Medusa's candidate tree (validated rank paths, sorted by depth); None: the top-1 chain.
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    acceptance_method: str = "rejection_sampler"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or a JSON object string; bad values raise ValueError naming the key."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", _KEYS)
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") else None
        method = ALIASES.get(method, method)
        if method in NOT_YET:
            raise ValueError(f"speculative_config.method: {method!r} is not supported yet; "
                             f"supported: {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: must be one of {list(METHODS)}, got {method!r}")

        def integer(key: str, default: int | None, low: int = 1) -> int:
            v = value.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"speculative_config.{key}: must be an integer >= {low}, got {v!r}")
            return v

        tree = _tree(value.get("speculative_token_tree"), method)
        if tree is not None and "num_speculative_tokens" not in value:
            value = {**value, "num_speculative_tokens": max(len(p) for p in tree)}
        k = integer("num_speculative_tokens", None)
        if tree is not None and k != max(len(p) for p in tree):
            raise ValueError(f"speculative_config.num_speculative_tokens: must equal the depth of "
                             f"speculative_token_tree ({max(len(p) for p in tree)}), got {k}")
        acceptance = value.get("acceptance_method", "rejection_sampler")
        if acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"speculative_config.acceptance_method: must be one of {list(ACCEPTANCE_METHODS)}, "
                             f"got {acceptance!r}")

        def fraction(key: str, default: float) -> float:
            v = value.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"speculative_config.{key}: must be a number in [0, 1], got {v!r}")
            return float(v)

        threshold, alpha = fraction("posterior_threshold", 0.09), fraction("posterior_alpha", 0.3)
        lo = integer("prompt_lookup_min", 1)
        hi = integer("prompt_lookup_max", max(lo, 4))
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: must be <= prompt_lookup_max ({hi}), got {lo}")
        model = value.get("model")
        if method in WITH_MODEL:
            if not isinstance(model, (str, os.PathLike)) or not str(model):
                what = {"draft_model": "draft model", "medusa": "Medusa heads"}.get(method, "EAGLE head")
                raise ValueError(f"speculative_config.model: a {what} directory is required for {method}")
            model = str(model)
        elif method == "mtp" and model is not None:
            if not isinstance(model, (str, os.PathLike)) or not str(model):
                raise ValueError("speculative_config.model: must be a directory holding the MTP layer")
            model = str(model)
        elif model is not None:
            raise ValueError(f"speculative_config.model: only used with methods {list(WITH_MODEL)}")
        return cls(method=method, num_speculative_tokens=k, model=model, prompt_lookup_max=hi,
                   prompt_lookup_min=lo, speculative_token_tree=tree, acceptance_method=acceptance,
                   posterior_threshold=threshold, posterior_alpha=alpha)


def _tree(value, method: str | None) -> tuple[tuple[int, ...], ...] | None:
    """vLLM's speculative_token_tree (a list, or the Python literal string vLLM stores) as
    validated paths; only Medusa's heads and EAGLE's / MTP's draft layer (its top-k per node) give more
    than one guess per position."""
    if value is None:
        return None
    if method not in TREE_METHODS:
        raise ValueError(f"speculative_config.speculative_token_tree: only used with methods {list(TREE_METHODS)}")
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError("speculative_config.speculative_token_tree: not a list of rank paths, "
                             f"got {value!r}") from None
    from kvserve.runtime.spec_decode.medusa_tree import parse_choices

    return parse_choices(value)
