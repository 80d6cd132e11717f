"""Which layers train in FP8 and which stay high precision, by module name.

    precision_map:
      default: fp8                # precision of every linear no rule matches
      keep_first_block: false     # blocks.0.*          -> high
      keep_last_block: false      # blocks.<last>.*     -> high
      keep_lm_head: true          # lm_head             -> high
      rules:                      # first match wins; fnmatch patterns on module names
        - {pattern: "blocks.*.mlp.w2", precision: high}

Embeddings are lookups, not matmuls: they are always high precision and listed as such. A linear
whose dimensions an FP8 GEMM cannot take (not multiples of 16; FP4 blocks need 16 or 32) falls
back to high precision whatever the rules say, and the reason is recorded as a `layer_fallback`
event. The map plugs into the model through `dtrain.model`'s `linear_factory` hook.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable

import torch.nn as nn

from dtrain.errors import UserError
from dtrain.model import GPTConfig, default_linear

PRECISIONS = ("fp8", "high")
EMBEDDINGS = ("tok_emb", "pos_emb")


@dataclass
class LayerDecision:
    name: str
    precision: str  # fp8 | high
    reason: str


class PrecisionMap:
    def __init__(self, rules: list[tuple[str, str]], default: str = "fp8", multiple: int = 16):
        for pattern, precision in rules:
            if precision not in PRECISIONS:
                raise UserError(f"precision_map rule {pattern!r}: precision={precision!r} is not one of "
                                f"{', '.join(PRECISIONS)}")
        if default not in PRECISIONS:
            raise UserError(f"precision_map.default={default!r} is not one of {', '.join(PRECISIONS)}")
        self.rules, self.default, self.multiple = list(rules), default, multiple
        self.decisions: list[LayerDecision] = []

    @classmethod
    def from_cfg(cls, node, model_cfg: GPTConfig, multiple: int = 16) -> "PrecisionMap":
        node = dict(node or {})
        rules = []
        if node.get("keep_first_block"):
            rules.append(("blocks.0.*", "high"))
        if node.get("keep_last_block"):
            rules.append((f"blocks.{model_cfg.n_layer - 1}.*", "high"))
        if node.get("keep_lm_head", False):
            rules.append(("lm_head", "high"))
        for rule in node.get("rules") or []:
            if not isinstance(rule, dict) or "pattern" not in rule or "precision" not in rule:
                raise UserError(f"precision_map rule {rule!r} needs 'pattern' and 'precision' keys")
            rules.append((str(rule["pattern"]), str(rule["precision"])))
        return cls(rules, node.get("default", "fp8"), multiple)

    def decide(self, name: str, in_features: int, out_features: int) -> LayerDecision:
        precision, reason = self.default, "default"
        for pattern, p in self.rules:
            if fnmatchcase(name, pattern):
                precision, reason = p, f"rule {pattern!r}"
                break
        if precision == "fp8" and (in_features % self.multiple or out_features % self.multiple):
            return LayerDecision(name, "high", f"fallback: in_features={in_features}, out_features="
                                 f"{out_features} not both multiples of {self.multiple} (FP8 GEMM shape rule)")
        return LayerDecision(name, precision, reason)

    def factory(self, fp8_linear: Callable[[str, int, int, bool], nn.Module],
                high_linear: Callable[[str, int, int, bool], nn.Module] = default_linear):
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
