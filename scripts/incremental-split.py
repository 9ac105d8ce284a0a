#!/usr/bin/env python3
"""Split a graph's TSV files into a base and a day's delta for incremental training.

Holds back a fraction of the entities of degree >= 3 (in train) with all their edges: each
held-back entity gives one of its edges to the delta's valid and one to its test file, the rest
to the delta's train file. The base keeps every other edge (its valid/test edges that name a
held-back entity are dropped). Writes into OUT:

  base-train.tsv base-valid.tsv base-test.tsv    the base graph
  delta-train.tsv delta-valid.tsv delta-test.tsv the held-back entities' edges

Usage: incremental-split.py TRAIN VALID TEST OUT [--fraction 0.1] [--seed 0]
"""

import argparse
import collections
import os
import random


def read(path):
    with open(path) as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]


def write(path, edges):
    with open(path, "w") as f:
        for e in edges:
            f.write("\t".join(e) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("train")
    ap.add_argument("valid")
    ap.add_argument("test")
    ap.add_argument("out")
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    train, valid, test = read(a.train), read(a.valid), read(a.test)
    degree = collections.Counter()
    for h, _, t in train:
        degree[h] += 1
        degree[t] += 1
    eligible = sorted(e for e, d in degree.items() if d >= 3)
    rng = random.Random(a.seed)
    held = set(rng.sample(eligible, int(len(eligible) * a.fraction)))
    touches = lambda e: e[0] in held or e[2] in held
    base_train = [e for e in train if not touches(e)]
    # An entity whose every train edge names a held-back one is new in the delta too.
    delta = [e for e in train if touches(e)]
    rng.shuffle(delta)
    # One valid and one test edge per held-back entity, taken from its delta edges when it
    # has at least three (so that one stays in train).
    count = collections.Counter()
    for h, _, t in delta:
        for x in (h, t):
            if x in held:
                count[x] += 1
    taken = {"valid": set(), "test": set()}
    delta_valid, delta_test, delta_train = [], [], []
    for e in delta:
        x = e[0] if e[0] in held else e[2]
        if count[x] >= 3 and x not in taken["valid"]:
            taken["valid"].add(x)
            count[x] -= 1
            delta_valid.append(e)
        elif count[x] >= 2 and x not in taken["test"]:
            taken["test"].add(x)
            count[x] -= 1
            delta_test.append(e)
        else:
            delta_train.append(e)
    keep = lambda edges: [e for e in edges if not touches(e)]
    os.makedirs(a.out, exist_ok=True)
    for name, edges in [
        ("base-train", base_train),
        ("base-valid", keep(valid)),
        ("base-test", keep(test)),
        ("delta-train", delta_train),
        ("delta-valid", delta_valid),
        ("delta-test", delta_test),
    ]:
        write(os.path.join(a.out, name + ".tsv"), edges)
    print(
        f"held back {len(held)} of {len(eligible)} entities of degree >= 3; base {len(base_train)} "
        f"train edges; delta {len(delta_train)} train / {len(delta_valid)} valid / "
        f"{len(delta_test)} test edges"
    )


if __name__ == "__main__":
    main()
