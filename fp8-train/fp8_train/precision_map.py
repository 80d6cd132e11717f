r"""Which layers train in FP8 and which stay high precision, by module name.

    precision_map:
      default: fp8                # precision of every linear no rule matches
      keep_first_block: false     # blocks.0.*          -> high
      keep_last_block: false      # blocks.<last>.*     -> high
      keep_lm_head: true          # lm_head             -> high
      rules:                      # first match wins; fnmatch patterns on module names
        - {pattern: "blocks.*.mlp.w2", precision: high}

On the command line: 'precision_map.rules=[{pattern: "blocks.0.*", precision: high}]'. Each rule is
checked on its own (`precision_map.rules[1]: needs a 'precision' key ...`), and a pattern that
matches no linear layer of the model (a typo, or a regular expression such as `blocks\.0\..*`,
which fnmatch reads literally) is refused with the layer names (`check_rules_match`).

Embeddings are lookups, not matmuls: they are always high precision and listed as such. A linear
whose dimensions an FP8 GEMM cannot take (not multiples of 16; FP4 blocks need 16 or 32) falls
back to high precision whatever the rules say, and the reason is recorded as a `layer_fallback`
event. The map plugs into the model through `dtrain.model.gpt`'s `linear_factory` hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable

from omegaconf import DictConfig, ListConfig, OmegaConf

import torch.nn as nn

from dtrain.core.errors import UserError, clip
from dtrain.model.gpt import GPTConfig, default_linear

PRECISIONS = ("fp8", "high")
EMBEDDINGS = ("tok_emb", "pos_emb")
RULE_KEYS = ("pattern", "precision")
RULE_SHAPE = "{pattern: <fnmatch pattern on layer names, e.g. blocks.0.*>, precision: fp8|high}"
HIGH_MEANS = "high: the run's non-FP8 precision, bf16 on GPU, fp32 on CPU"
REGEX_SIGNS = ("\\", "^", "$", "+", "(", ")", "|", "{")  # in a pattern: likely a regular expression


@dataclass
class LayerDecision:
    name: str
    precision: str  # fp8 | high
    reason: str


class PrecisionMap:
    def __init__(self, rules: list[tuple[str, str]], default: str = "fp8", multiple: int = 16):
        for pattern, precision in rules:
            if precision not in PRECISIONS:
                raise UserError(
                    f"precision_map rule {pattern!r}: precision={precision!r} is not one of "
                    f"{', '.join(PRECISIONS)}"
                )
        if default not in PRECISIONS:
            raise UserError(
                f"precision_map.default={default!r} is not one of {', '.join(PRECISIONS)}"
            )
        self.rules, self.default, self.multiple = list(rules), default, multiple
        self.decisions: list[LayerDecision] = []

    @classmethod
    def from_cfg(cls, node, model_cfg: GPTConfig, multiple: int = 16) -> "PrecisionMap":
        node = _plain(node) or {}
        rules = []
        if node.get("keep_first_block"):
            rules.append(("blocks.0.*", "high"))
        if node.get("keep_last_block"):
            rules.append((f"blocks.{model_cfg.n_layer - 1}.*", "high"))
        if node.get("keep_lm_head", False):
            rules.append(("lm_head", "high"))
        rules += user_rules(node.get("rules"))
        return cls(rules, node.get("default", "fp8"), multiple)

    def decide(self, name: str, in_features: int, out_features: int) -> LayerDecision:
        precision, reason = self.default, "default"
        for pattern, p in self.rules:
            if fnmatchcase(name, pattern):
                precision, reason = p, f"rule {pattern!r}"
                break
        if precision == "fp8" and (in_features % self.multiple or out_features % self.multiple):
            return LayerDecision(
                name,
                "high",
                f"fallback: in_features={in_features}, out_features="
                f"{out_features} not both multiples of {self.multiple} (FP8 GEMM shape rule)",
            )
        return LayerDecision(name, precision, reason)

    def factory(
        self,
        fp8_linear: Callable[[str, int, int, bool], nn.Module],
        high_linear: Callable[[str, int, int, bool], nn.Module] = default_linear,
    ):
        """A `linear_factory` that builds each layer in its decided precision and remembers why."""

        def make(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
            d = self.decide(name, in_features, out_features)
            self.decisions.append(d)
            build = fp8_linear if d.precision == "fp8" else high_linear
            return build(name, in_features, out_features, bias)

        return make

    def all_decisions(self) -> list[LayerDecision]:
        embeddings = [LayerDecision(n, "high", "embedding lookup (no matmul)") for n in EMBEDDINGS]
        return embeddings + self.decisions

    def high_precision_layers(self) -> list[str]:
        return [d.name for d in self.all_decisions() if d.precision == "high"]

    def fallbacks(self) -> list[LayerDecision]:
        return [d for d in self.decisions if d.reason.startswith("fallback")]


def _plain(value):
    """A config node as plain Python (the command line's rules are DictConfigs, not dicts)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def user_rules(rules) -> list[tuple[str, str]]:
    """`precision_map.rules` as (pattern, precision) pairs; a bad rule is named by its index."""
    rules = _plain(rules)
    if rules is None:
        return []
    if not isinstance(rules, list):
        raise UserError(
            f"precision_map.rules={clip(repr(rules))} must be a list of rules "
            f"{RULE_SHAPE}, "
            "e.g. 'precision_map.rules=[{pattern: \"blocks.0.*\", precision: high}]'"
        )
    return [_rule(i, rule) for i, rule in enumerate(rules)]


def _rule(i: int, rule) -> tuple[str, str]:
    where = f"precision_map.rules[{i}]"
    if not isinstance(rule, dict):
        raise UserError(f"{where}={clip(repr(rule))} is not a rule: write {RULE_SHAPE}")
    unknown = [str(k) for k in rule if k not in RULE_KEYS]
    if unknown:
        raise UserError(
            f"{where}: unknown key {clip(repr(unknown[0]))}: a rule has only "
            f"{' and '.join(RULE_KEYS)}, {RULE_SHAPE}"
        )
    if "pattern" not in rule:
        raise UserError(
            f"{where}: needs a 'pattern' key (an fnmatch pattern on layer names, e.g. "
            "blocks.0.* or lm_head)"
        )
    if "precision" not in rule:
        raise UserError(
            f"{where}: needs a 'precision' key (one of {', '.join(PRECISIONS)}; {HIGH_MEANS})"
        )
    pattern, precision = rule["pattern"], rule["precision"]
    if not isinstance(pattern, str) or not pattern:
        raise UserError(
            f"{where}: pattern={clip(repr(pattern))} must be a non-empty fnmatch "
            "pattern on layer names, e.g. blocks.0.*"
        )
    if precision not in PRECISIONS:
        raise UserError(
            f"{where}: precision={clip(repr(precision))} is not one of "
            f"{', '.join(PRECISIONS)} ({HIGH_MEANS})"
        )
    return pattern, precision


def check_rules_match(node, linear_names: list[str]) -> None:
    """Every user rule matches at least one linear layer: a rule that matches none changes nothing,
    which is a typo or a regular expression (patterns are fnmatch: `blocks\\.0\\..*` is literal)."""
    for i, (pattern, _) in enumerate(user_rules((_plain(node) or {}).get("rules"))):
        if any(fnmatchcase(name, pattern) for name in linear_names):
            continue
        regex = any(sign in pattern for sign in REGEX_SIGNS)
        why = "patterns are fnmatch, not regular expressions" if regex else "check the layer name"
        names = linear_names
        if len(names) > 8:
            names = [*names[:6], "...", names[-1]]
        raise UserError(
            f"precision_map.rules[{i}]: pattern {clip(repr(pattern))} matches no "
            f"linear layer of this model ({', '.join(names)}): {why}, e.g. blocks.0.* "
            "or blocks.*.mlp.w2"
        )
