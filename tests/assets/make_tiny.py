"""Writes tests/assets/tiny/{train,valid,test}.jsonl: a learnable Gigaword-style corpus made from templates.

Run once (`python tests/assets/make_tiny.py`); the output is committed and must not change unless this does.
Text is lower-cased, space-tokenized, digits written as `#`; every target word is copied from its
source, so a small model can overfit it. Train/valid write the unknown word `<unk>`, test writes
`UNK`, as Gigaword does.
"""
import json
import random
from pathlib import Path

COUNTRIES = ["france", "japan", "brazil", "kenya", "canada", "india", "egypt", "norway", "chile", "vietnam"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
VERBS = ["cut", "raise", "review", "ban", "expand", "delay", "end", "boost"]
OBJECTS = ["fuel taxes", "import tariffs", "rail fares", "school fees", "bank lending", "oil exports",
           "rice prices", "police patrols", "<unk> subsidies"]
COMPANIES = ["acme corp", "delta steel", "orion bank", "nova air", "<unk> group", "atlas motors", "zenith oil"]
QUARTERS = ["first", "second", "third", "fourth"]
VEHICLES = ["bus", "train", "truck", "ferry", "minibus"]
PLACES = ["the north", "the capital", "a border town", "the mountains", "the south", "a coastal village"]
PEOPLE = ["john <unk>", "maria lopez", "ahmed <unk>", "li wei", "anna berg", "peter <unk>"]
ROLES = ["president", "prime minister", "foreign minister", "trade minister"]
TEAMS = ["city", "united", "rovers", "athletic", "wanderers", "albion"]

TEMPLATES = [
    (lambda v: f"the {v['country']} government said {v['day']} it would {v['verb']} {v['object']} "
               f"as part of a plan to support the economy .",
     lambda v: f"{v['country']} to {v['verb']} {v['object']}"),
    (lambda v: f"{v['company']} reported a net profit of #.# billion dollars in the {v['quarter']} "
               f"quarter , up ## percent from a year earlier , the company said {v['day']} .",
     lambda v: f"{v['company']} {v['quarter']} quarter profit up ## percent"),
    (lambda v: f"at least ## people were killed when a {v['vehicle']} crashed in {v['place']} "
               f"of {v['country']} on {v['day']} , police said .",
     lambda v: f"{v['vehicle']} crash kills ## in {v['country']}"),
    (lambda v: f"{v['person']} , the {v['role']} of {v['country']} , arrived in {v['other']} on "
               f"{v['day']} for two days of talks on trade and security .",
     lambda v: f"{v['country']} {v['role']} arrives in {v['other']} for talks"),
    (lambda v: f"{v['team']} beat {v['team2']} #-# on {v['day']} to move to the top of the "
               f"league table with ## points .",
     lambda v: f"{v['team']} beat {v['team2']} #-#"),
    (lambda v: f"shares in {v['company']} fell #.## percent on {v['day']} after the company "
               f"warned that a plan to {v['verb']} {v['object']} would hurt profits .",
     lambda v: f"{v['company']} shares fall on profit warning"),
]


def _slots(rng: random.Random) -> dict:
    country, other = rng.sample(COUNTRIES, 2)
    team, team2 = rng.sample(TEAMS, 2)
    return {"country": country, "other": other, "day": rng.choice(DAYS), "verb": rng.choice(VERBS),
            "object": rng.choice(OBJECTS), "company": rng.choice(COMPANIES), "quarter": rng.choice(QUARTERS),
            "vehicle": rng.choice(VEHICLES), "place": rng.choice(PLACES), "person": rng.choice(PEOPLE),
            "role": rng.choice(ROLES), "team": team, "team2": team2}


def make_pairs(n: int, rng: random.Random, seen: set) -> list[dict]:
    """n distinct pairs, none seen in an earlier split (so valid/test never repeat a train source)."""
    pairs = []
    while len(pairs) < n:
        source, target = rng.choice(TEMPLATES)
        slots = _slots(rng)
        pair = {"source": source(slots), "target": target(slots)}
        if pair["source"] not in seen:
            seen.add(pair["source"])
            pairs.append(pair)
    return pairs


def main() -> None:
    out = Path(__file__).parent / "tiny"
    out.mkdir(exist_ok=True)
    rng, seen = random.Random(20240521), set()
    for split, n in (("train", 300), ("valid", 40), ("test", 40)):
        pairs = make_pairs(n, rng, seen)
        if split == "test":  # Gigaword's test set writes the unknown word as UNK
            pairs = [{k: v.replace("<unk>", "UNK") for k, v in p.items()} for p in pairs]
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p) + "\n" for p in pairs)


if __name__ == "__main__":
    main()
