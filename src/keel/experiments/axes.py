"""The axes of a runner's grid (`keel maxlr`, `keel sweep`): Keel's alpha as a number or an expression in L,
directory-safe axis values, the width that holds a non-embedding parameter budget at a depth."""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import replace

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.model import parameter_counts

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def resolve_alpha(expr: str | float, n_sublayers: int) -> float:
    """Keel's alpha from a number or an arithmetic expression in L, the number of sublayers: `1`, `sqrt(L)`,
    `L/2`, `L`, `2L`, `L**0.75`. Evaluated on a whitelist of AST nodes, never with eval()."""
    text = re.sub(r"(\d)\s*(?=L|sqrt|\()", r"\1*", str(expr).strip())  # implicit product: 2L -> 2*L

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id == "L":
            return float(n_sublayers)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sqrt" and len(node.args) == 1:
            return math.sqrt(value(node.args[0]))
        raise ValueError(ast.dump(node))

    try:
        alpha = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        raise ConfigError(
            f"alpha {expr!r}: not a number or an expression in L (e.g. 1, sqrt(L), L/2, L, 2L): {err}"
        ) from None
    if not alpha > 0:
        raise ConfigError(f"alpha {expr!r} = {alpha} at L = {n_sublayers}: must be > 0")
    return alpha


def slug(text: str) -> str:
    """A directory-safe form of an axis value: sqrt(L) -> sqrtL, L/2 -> Ldiv2, 3e-3 -> 3e-3."""
    return re.sub(r"[^\w.+-]", "", str(text).replace("/", "div").replace("*", "x"))


def non_embedding_params(model: ModelConfig) -> int:
    """Parameters outside the embedding and the LM head (Kaplan et al.'s count): the blocks and the final norm."""
    counts = parameter_counts(model)
    return counts["blocks"] + counts["final_norm"]


def width_for_budget(model: ModelConfig, depth: int, budget: int) -> int:
    """The width (a multiple of 2 * n_heads: even head dim for RoPE) whose non-embedding parameter count at
    `depth` is closest to `budget`, n_heads and the FFN ratio kept. The count grows with width, so bisect."""
    step = 2 * model.n_heads

    def params(width: int) -> int:
        return non_embedding_params(replace(model, depth=depth, width=width))

    lo, hi = 1, 2
    while params(hi * step) < budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: params(lo * step) < budget <= params(hi * step), or lo = 1
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params(mid * step) < budget else (lo, mid)
    return min((lo * step, hi * step), key=lambda width: abs(params(width) - budget))
