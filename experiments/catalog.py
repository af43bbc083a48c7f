"""The shape catalog: every (N, K) = (out_features, in_features) of the decoder linears of public open models.

    python -m experiments catalog                    # shape, weights, subset, the models and layers it comes from
    python -m experiments catalog --subset held-out  # one subset only
    python -m experiments catalog --json             # the same as JSON

`experiments/shapes.json` holds each model's config numbers (hidden_size, intermediate_size, heads, kv_heads,
head_dim) with the config.json they come from and the copies they were checked against; this module derives the
shapes from them, so each number has one home. Only the decoder layers' linears: no embedding, no lm_head, no MoE
router. Per model and tensor-parallel degree tp (1 and 2):

- attention: q (heads * head_dim, hidden), k and v (kv_heads * head_dim, hidden), o (hidden, heads * head_dim), and
  the fused qkv ((heads + 2 * kv_heads) * head_dim, hidden) that vLLM loads (and Phi-3's checkpoint holds);
- MLP: gate and up (intermediate, hidden), down (hidden, intermediate), and the fused gate_up (2 * intermediate,
  hidden) (Mixtral: one expert's, named `experts.*`);
- tp splits the column-parallel layers' out_features (q, k, v, qkv, gate, up, gate_up) and the row-parallel
  layers' in_features (o, down) by tp; KV heads fewer than tp are replicated, one per rank, as vLLM does;
- separate q/k/v and gate/up exist where the checkpoint has them (transformers, PEFT and bitsandbytes quantize
  the checkpoint's layers); a model whose checkpoint is fused (`checkpoint_fused`: Phi-3) has only the fused forms.
  A model with `attention: "mla"` (DeepSeek-V2-Lite) contributes its dense MLP only.

The split (`fit_shapes()`, `held_out_shapes()`): a shape is held out when the SHA-256 of its name "NxK", read as a
big-endian integer, is divisible by 3, so about a third is held out. The rule looks at the shape alone: adding a
model to the catalog never moves a shape from one subset to the other. Tuning is fit on `fit_shapes()` and reported
on `held_out_shapes()`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DATA = Path(__file__).with_name("shapes.json")
TP_DEGREES = (1, 2)
FIT, HELD_OUT = "fit", "held-out"
FUSED = ("qkv_proj", "gate_up_proj")
SEPARATE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # what a fused checkpoint lacks
_NUMBERS = ("hidden_size", "intermediate_size", "heads", "kv_heads")


@dataclass(frozen=True)
class Use:
    """One place a shape occurs: a model's layer at a tensor-parallel degree (fused: a qkv or gate_up form)."""

    model: str
    layer: str
    tp: int
    fused: bool


@dataclass(frozen=True)
class Shape:
    """A weight of N x K (out_features x in_features) and every use of it in the catalog."""

    n: int
    k: int
    uses: tuple[Use, ...]

    @property
    def name(self) -> str:
        return f"{self.n}x{self.k}"

    @property
    def weights(self) -> int:
        return self.n * self.k

    @property
    def subset(self) -> str:
        return subset(self.n, self.k)

    def models(self) -> list[str]:
        """The models it occurs in, in catalog order, each once."""
        return list(dict.fromkeys(u.model for u in self.uses))


def model_name(model: dict) -> str:
    """'Llama 3.1 8B': the family and size as the catalog names a model."""
    return f"{model['family']} {model['size']}"


def _check(model: dict) -> None:
    name = model_name(model)
    for key in _NUMBERS:
        if not isinstance(model[key], int) or model[key] <= 0:
            raise ValueError(f"{name}: {key} must be a positive integer, got {model[key]!r}")
    if not model["source"].startswith("https://"):
        raise ValueError(f"{name}: source must be a URL, got {model['source']!r}")
    if model["mlp"] not in ("dense", "experts"):
        raise ValueError(f"{name}: mlp must be 'dense' or 'experts', got {model['mlp']!r}")
    if model["attention"] == "mla":
        return
    if model["attention"] != "standard":
        raise ValueError(f"{name}: attention must be 'standard' or 'mla', got {model['attention']!r}")
    heads, kv, head_dim = model["heads"], model["kv_heads"], model["head_dim"]
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"{name}: head_dim must be a positive integer, got {head_dim!r}")
    if model["head_dim_from"] == "hidden_size / heads" and heads * head_dim != model["hidden_size"]:
        raise ValueError(f"{name}: head_dim {head_dim} is not hidden_size / heads")
    if heads % kv:
        raise ValueError(f"{name}: heads {heads} is not a multiple of kv_heads {kv}")


@cache
def models() -> tuple[dict, ...]:
    """The models of experiments/shapes.json, checked (positive numbers, a source URL, consistent heads)."""
    found = json.loads(DATA.read_text())["models"]
    for model in found:
        _check(model)
    return tuple(found)


def _split(value: int, tp: int, what: str, name: str) -> int:
    if value % tp:
        raise ValueError(f"{name}: {what} {value} does not split over tp={tp}")
    return value // tp


def _kv_heads_per_rank(kv: int, tp: int, name: str) -> int:
    """vLLM's rule: KV heads split over the ranks, or, fewer than tp, each replicated onto tp / kv ranks."""
    if kv >= tp:
        return _split(kv, tp, "kv_heads", name)
    if tp % kv:
        raise ValueError(f"{name}: kv_heads {kv} cannot be replicated over tp={tp}")
    return 1


def layers(model: dict, tp: int) -> list[tuple[str, int, int]]:
    """(layer, N, K) of one model's decoder linears on one rank at tensor-parallel degree tp."""
    name = model_name(model)
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    out: list[tuple[str, int, int]] = []
    if model["attention"] == "standard":
        head_dim = model["head_dim"]
        q = _split(model["heads"], tp, "heads", name) * head_dim
        kv = _kv_heads_per_rank(model["kv_heads"], tp, name) * head_dim
        out += [("q_proj", q, hidden), ("k_proj", kv, hidden), ("v_proj", kv, hidden),
                ("qkv_proj", q + 2 * kv, hidden), ("o_proj", hidden, q)]
    inter_rank = _split(inter, tp, "intermediate_size", name)
    prefix = "experts." if model["mlp"] == "experts" else ""
    out += [(prefix + "gate_proj", inter_rank, hidden), (prefix + "up_proj", inter_rank, hidden),
            (prefix + "gate_up_proj", 2 * inter_rank, hidden), (prefix + "down_proj", hidden, inter_rank)]
    if model["checkpoint_fused"]:
        out = [o for o in out if o[0].split(".")[-1] not in SEPARATE]
    return out


def shapes_from(model_list) -> list[Shape]:
    """Every distinct (N, K) of the models' layers at TP_DEGREES, sorted by (N, K), with the uses of each."""
    uses: dict[tuple[int, int], list[Use]] = defaultdict(list)
    for model in model_list:
        for tp in TP_DEGREES:
            for layer, n, k in layers(model, tp):
                uses[(n, k)].append(Use(model_name(model), layer, tp, layer.split(".")[-1] in FUSED))
    return [Shape(n, k, tuple(u)) for (n, k), u in sorted(uses.items())]


@cache
def catalog() -> tuple[Shape, ...]:
    """The catalog: every distinct (N, K) of experiments/shapes.json's models, sorted by (N, K)."""
    return tuple(shapes_from(models()))


def subset(n: int, k: int) -> str:
    """'held-out' when SHA-256("NxK") is divisible by 3, else 'fit': fixed per shape, whatever else is catalogued."""
    digest = hashlib.sha256(f"{n}x{k}".encode()).digest()
    return HELD_OUT if int.from_bytes(digest, "big") % 3 == 0 else FIT


def fit_shapes() -> tuple[Shape, ...]:
    """The shapes tuning may be fit on (about two thirds of the catalog)."""
    return tuple(s for s in catalog() if s.subset == FIT)


def held_out_shapes() -> tuple[Shape, ...]:
    """The shapes tuning is reported on and never fit on (about a third of the catalog)."""
    return tuple(s for s in catalog() if s.subset == HELD_OUT)


def _uses_text(shape: Shape) -> str:
    by_model: dict[str, list[str]] = defaultdict(list)
    for u in shape.uses:
        by_model[u.model].append(f"{u.layer}@tp{u.tp}")
    return "; ".join(f"{m}: {', '.join(ls)}" for m, ls in by_model.items())


def _weights_text(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 10**6 else f"{count / 1e3:.0f}k"


def to_json(selected) -> dict:
    """The catalog as JSON: the models with their sources, the split rule, and the shapes with their uses."""
    return {
        "models": [{"name": model_name(m), **m} for m in models()],
        "tp_degrees": list(TP_DEGREES),
        "split": "held-out when int(sha256('NxK'), big-endian) % 3 == 0, else fit",
        "shapes": [{"n": s.n, "k": s.k, "name": s.name, "weights": s.weights, "subset": s.subset,
                    "uses": [{"model": u.model, "layer": u.layer, "tp": u.tp, "fused": u.fused} for u in s.uses]}
                   for s in selected],
    }


def table(selected) -> str:
    """One line per shape: N x K, weights, subset, then the models and layers@tp it comes from."""
    lines = [f"{'N x K':>13} {'weights':>8} {'subset':>8}  from"]
    for s in selected:
        lines.append(f"{s.name:>13} {_weights_text(s.weights):>8} {s.subset:>8}  {_uses_text(s)}")
    n_fit = sum(s.subset == FIT for s in selected)
    lines.append(f"{len(selected)} shapes ({n_fit} fit, {len(selected) - n_fit} held-out) from {len(models())} "
                 f"models at tp {', '.join(map(str, TP_DEGREES))}; sources in {DATA.name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments catalog", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--subset", choices=("all", FIT, HELD_OUT), default="all", help="which shapes to list")
    args = ap.parse_args(argv)
    selected = {"all": catalog(), FIT: fit_shapes(), HELD_OUT: held_out_shapes()}[args.subset]
    print(json.dumps(to_json(selected), indent=1) if args.json else table(selected))
    return 0


if __name__ == "__main__":
    sys.exit(main())
