"""Mixed bit widths: which layers get more bits than the model's base width, within a budget.

A rule list (the quantize option ``layer_bits``) names layers by regular expression (``re.search``
on the layer name, e.g. ``v_proj`` or ``layers\\.(2[5-9])\\.mlp\\.down_proj``) and gives them
``add`` bits over the base width (or an absolute ``bits``); a later rule wins where two match. The
same rules serve every base width (the pipeline quantizes each model at 2, 3 and 4 bits), so they
say "+1 bit for these layers", not "5 bits".

Which layers: the ones where a bit buys the most. :func:`greedy` picks, from measured gains (the KL
to the source saved by one more bit on a group of layers, others unchanged; KL is close to
additive over layers, docs/results/2026-12-05-logs/quality-history.md) and costs (the group's
weights), the groups with the best gain per bit until a budget of extra bits per weight is spent. ``scripts/bits_sweep.py`` measures
the gains on the calibration text and prints the rules.
"""

import re

from .codebook import LAYER_BITS


def check_rules(rules):
    """Rules as given in the config: [{"match": REGEX, "add": N} or {"match": REGEX, "bits": N}]."""
    if not isinstance(rules, (list, tuple)):
        raise ValueError(f"layer_bits must be a list of {{match, add|bits}} rules, got {type(rules).__name__}")
    for i, r in enumerate(rules):
        if not isinstance(r, dict) or not isinstance(r.get("match"), str) or len(set(r) & {"add", "bits"}) != 1 \
                or set(r) - {"match", "add", "bits"}:
            raise ValueError(f"layer_bits rule {i} must be {{match: REGEX, add: N}} or {{match: REGEX, bits: N}}, got {r!r}")
        value = r.get("add", r.get("bits"))
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"layer_bits rule {i}: {'add' if 'add' in r else 'bits'} must be an integer, got {value!r}")
        try:
            re.compile(r["match"])
        except re.error as e:
            raise ValueError(f"layer_bits rule {i}: bad regular expression {r['match']!r}: {e}") from None
    return list(rules)


def resolve(rules, names, bits):
    """{name: width} for the ``names`` a rule matches (others keep the base ``bits``).

    Every rule must match some layer (a rule that matches nothing is a typo or a model it was not
    made for) and every width must be one a layer can have (codebook.LAYER_BITS)."""
    rules = check_rules(rules)
    out = {}
    for i, r in enumerate(rules):
        rx = re.compile(r["match"])
        hit = [n for n in names if rx.search(n)]
        if not hit:
            raise ValueError(f"layer_bits rule {i} ({r['match']!r}) matches no quantized layer")
        width = r["bits"] if "bits" in r else bits + r["add"]
        if width not in LAYER_BITS:
            raise ValueError(f"layer_bits rule {i} ({r['match']!r}) gives {width} bits at base {bits}; "
                             f"a layer can have {LAYER_BITS}")
        out.update({n: width for n in hit})
    return {n: b for n, b in out.items() if b != bits}


def greedy(gains, costs, budget):
    """The groups to give one more bit: ``gains`` {group: KL saved}, ``costs`` {group: extra bits},
    ``budget`` total extra bits. Best gain per bit first; a group that no longer fits is skipped
    (a smaller one after it may still fit). Returns the chosen groups in order of choice."""
    order = sorted((g for g in gains if gains[g] > 0), key=lambda g: gains[g] / costs[g], reverse=True)
    chosen, spent = [], 0.0
    for g in order:
        if spent + costs[g] <= budget:
            chosen.append(g)
            spent += costs[g]
    return chosen
