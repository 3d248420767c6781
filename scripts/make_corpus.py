"""Regenerate ``corpus.txt``: our own prose (``prose.txt``) plus text generated from templates.

The synthetic tokenizers (``vqpipe.sources.synth``) are trained on ``corpus.txt``; everything in it is
written for this repository. Run ``python scripts/make_corpus.py`` after editing the
templates or the prose; the output is deterministic (``random.Random`` with a fixed seed).
"""

import random
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "vqpipe" / "data"
SEED = 20261130
TARGET_BYTES = 420_000

NAMES = (
    "Ada Bram Cleo Dario Elin Farid Greta Hugo Ines Jonas Kira Lars Maya Nico Olga Pavel Quinn "
    "Rosa Sami Tilde Umar Vera Wim Xenia Yusuf Zora Anton Bea Cyril Dana Emil Fenna Gus Hanna "
    "Ivo Juno Kai Lena Milo Nora Otto Pia Rafael Sofia Theo Ulla Viktor Wanda"
).split()
PLACES = (
    "the harbour,the old mill,the market square,the library,the train station,the orchard,"
    "the workshop,the hill path,the river bank,the bakery,the school yard,the lighthouse,"
    "the museum,the garden,the bridge,the kitchen,the post office,the forest edge,the attic,"
    "the greenhouse,the laboratory,the stadium,the ferry dock,the village hall,the cellar"
).split(",")
TOWNS = (
    "Amberley Brackwater Colden Dunmore Elstow Fennick Galloway Harrowgate Ilsby Juniper "
    "Kestrel Lowmoor Marrow Northcote Oakridge Pellham Quarry Redford Saltmarsh Thornbury "
    "Upton Vellis Westerby Yarrow Zennor"
).split()
NOUNS = (
    "apple basket bicycle blanket book bottle bridge candle chair clock cloud coat compass "
    "cup door drawer engine feather fence field flag flower garden gate glass hammer hat "
    "island jacket jar kettle key ladder lamp leaf letter map mirror needle notebook orange "
    "paint pencil pillow plate pocket pond radio rope saddle scarf shell shoe shovel spoon "
    "stamp stone string suitcase table teapot ticket tower train tree umbrella violin wagon "
    "wall watch wheel window wire basket storm river mountain valley meadow forest desert "
    "planet comet signal message number pattern puzzle recipe song story question answer "
    "promise journey harvest winter summer autumn spring morning evening midnight holiday "
    "library museum theatre market kitchen office factory harbour village city country "
    "matrix vector tensor weight gradient layer model token cache kernel buffer socket "
    "thread process server client packet header payload record column index queue stack "
    "file folder module function variable parameter argument result error warning report"
).split()
ADJECTIVES = (
    "old new small large quiet loud bright dark warm cold soft hard heavy light quick slow "
    "careful careless gentle rough smooth narrow wide deep shallow early late green blue red "
    "yellow golden silver wooden broken shiny dusty clean strange familiar simple complex "
    "sharp blunt sweet bitter fresh stale hidden open empty full rare common tiny enormous "
    "patient curious brave tired cheerful serious honest clever modest proud calm nervous "
    "random sparse dense orthogonal linear stable noisy precise rough compressed quantized"
).split()
VERBS = (
    "carry:carried build:built find:found open:opened close:closed paint:painted fix:fixed "
    "read:read write:wrote draw:drew hold:held lift:lifted move:moved pack:packed push:pushed "
    "pull:pulled wash:washed fold:folded measure:measured count:counted sort:sorted "
    "follow:followed visit:visited watch:watched notice:noticed borrow:borrowed lend:lent "
    "repair:repaired polish:polished plant:planted water:watered bake:baked cook:cooked "
    "sell:sold buy:bought keep:kept leave:left forget:forgot remember:remembered "
    "compress:compressed rotate:rotated encode:encoded decode:decoded load:loaded "
    "save:saved test:tested compare:compared measure:measured train:trained"
).split()
VERBS = [tuple(v.split(":")) for v in VERBS]
PREPS = "near behind beside under above inside outside across along past beyond toward".split()
TIMES = (
    "in the morning,after lunch,before dawn,late at night,on Sunday,last winter,every Tuesday,"
    "during the storm,at noon,in early spring,the next day,a week later,just before dinner"
).split(",")
UNITS = "metres kilometres grams kilograms litres seconds minutes hours days years degrees".split()
WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = (
    "January February March April May June July August September October November December"
).split()
EXTRA = (
    "café naïve façade jalapeño crème brûlée déjà vu São Paulo Zürich Kraków Malmö "
    "20 °C, 5 € and 3 £; 1 µs ≈ 0.001 ms; x² + y² = r²; α β γ δ λ π σ; — … « » “quoted”"
).split()


def sentence(r):
    name, other = r.sample(NAMES, 2)
    verb, past = r.choice(VERBS)
    noun, noun2 = r.sample(NOUNS, 2)
    adj, adj2 = r.sample(ADJECTIVES, 2)
    place, time = r.choice(PLACES), r.choice(TIMES)
    forms = [
        f"{name} {past} the {adj} {noun} {r.choice(PREPS)} {place} {time}.",
        f"{time.capitalize()}, {name} and {other} {past} a {adj} {noun} at {place}.",
        f"Why did {name} {verb} the {noun} {r.choice(PREPS)} the {adj2} {noun2}?",
        f"The {noun} was {adj}, but the {noun2} was {adj2}.",
        f"If you {verb} the {noun} {time}, it stays {adj} for {r.randint(2, 40)} {r.choice(UNITS)}.",
        f"\"Please {verb} the {adj} {noun},\" said {name}. \"{other} needs it {time}.\"",
        f"In {r.choice(TOWNS)}, people {verb} {adj} {noun}s {r.choice(PREPS)} {place}.",
        f"{name} wanted to {verb} every {noun} in {r.choice(TOWNS)}, which took {r.randint(2, 90)} days.",
    ]
    return r.choice(forms)


def paragraph(r):
    return " ".join(sentence(r) for _ in range(r.randint(3, 7)))


def arithmetic(r):
    a, b = r.randint(0, 999), r.randint(1, 999)
    ops = [
        f"{a} + {b} = {a + b}",
        f"{a} - {b} = {a - b}",
        f"{a} * {b} = {a * b}",
        f"{a * b} / {b} = {a}",
        f"{a}.{b % 100:02d} rounded to one decimal is {round(a + (b % 100) / 100, 1)}",
        f"{b} in binary is {b:b} and in hex is 0x{b:x}",
        f"{a}% of {b * 4} is {a * b * 4 / 100:g}",
    ]
    return r.choice(ops)


def dated(r):
    day, month, year = r.randint(1, 28), r.choice(MONTHS), r.randint(1850, 2030)
    temp = r.randint(-15, 38)
    town = r.choice(TOWNS)
    return r.choice([
        f"On {r.choice(WEEKDAYS)}, {day} {month} {year}, the temperature in {town} was {temp} °C.",
        f"{town} Gazette, {month} {year}: a {r.choice(ADJECTIVES)} {r.choice(NOUNS)} was found at {r.choice(PLACES)}.",
        f"{year}-{MONTHS.index(month) + 1:02d}-{day:02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00Z "
        f"INFO {r.choice(NOUNS)}: {r.randint(1, 9999)} items processed in {r.randint(1, 999)} ms",
    ])


def code(r):
    verb, _ = r.choice(VERBS)
    noun, noun2 = r.sample(NOUNS, 2)
    n = r.randint(2, 64)
    return r.choice([
        f"def {verb}_{noun}({noun2}s, limit={n}):\n"
        f"    \"\"\"{verb.capitalize()} at most {n} {noun}s.\"\"\"\n"
        f"    result = []\n"
        f"    for i, {noun2} in enumerate({noun2}s):\n"
        f"        if i >= limit:\n"
        f"            break\n"
        f"        result.append({noun2})\n"
        f"    return result\n",
        f"{{\"{noun}\": \"{r.choice(ADJECTIVES)}\", \"count\": {n}, \"{noun2}\": [{n * 2}, {n * 3}], "
        f"\"ok\": {r.choice(['true', 'false'])}}}",
        f"for (int i = 0; i < {n}; ++i) {{\n    {noun}[i] = {noun2}[i] * {r.randint(2, 9)};\n}}",
        f"$ python -m {noun} --{verb} {noun2}.txt --limit {n}\n{verb}ed {n} {noun2}s in {r.random():.3f} s",
        f"| {noun} | {noun2} | {n} |\n| --- | --- | --- |\n| {r.choice(ADJECTIVES)} | {r.choice(ADJECTIVES)} | {n * 7} |",
        f"x = mx.random.normal(({n}, {n * 4}))\ny = {verb}(x, axis=-1)  # shape ({n}, {n * 4})",
    ])


def dialog(r):
    verb, past = r.choice(VERBS)
    noun, adj = r.choice(NOUNS), r.choice(ADJECTIVES)
    name = r.choice(NAMES)
    return r.choice([
        f"User: How do I {verb} a {adj} {noun}?\nAssistant: Start small. First {verb} one {noun}, "
        f"check the result, and only then repeat it for the rest.",
        f"User: What is a {noun}?\nAssistant: A {noun} is a {adj} thing that people {verb} every day. "
        f"{name} once {past} {r.randint(2, 50)} of them in a single afternoon.",
        f"User: Can you {verb} the {noun} for me?\nAssistant: Sure. I {past} the {noun}; it is now {adj}.",
        f"User: Is {r.randint(2, 999)} a prime number?\nAssistant: Let me check the divisors one by one.",
    ])


def extra(r):
    return " ".join(r.sample(EXTRA, r.randint(3, 8)))


def corpus_text():
    r = random.Random(SEED)
    makers = [paragraph] * 5 + [arithmetic, dated, code, dialog, extra]
    parts = [(HERE / "prose.txt").read_text(encoding="utf-8")]
    size = len(parts[0].encode())
    while size < TARGET_BYTES:
        text = r.choice(makers)(r)
        parts.append(text)
        size += len(text.encode()) + 2
    return "\n\n".join(parts) + "\n"


def main():
    (HERE / "corpus.txt").write_text(corpus_text(), encoding="utf-8")


if __name__ == "__main__":
    main()
