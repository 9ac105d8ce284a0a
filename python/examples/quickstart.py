# %% [markdown]
# # Legend from Python: train UMLS, predict, plot nearest neighbours
#
# A notebook in script form (cells split by `# %%`: Jupyter with jupytext, VS Code and
# PyCharm open it as one). Run it whole with
#
#     python python/examples/quickstart.py [--epochs N] [--work DIR]
#
# It fetches UMLS (135 entities, 46 relations) from the pykeen wheel as scripts/main-job.sh
# does, imports it, trains the DistMult recipe of configs/, asks the run questions and plots
# an entity's nearest neighbours (matplotlib, when installed; the plot is skipped otherwise).

# %%
import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import legend

root = Path(__file__).resolve().parents[2]
cache = Path(os.environ.get("LEGEND_CACHE", Path.home() / ".cache" / "legend"))
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=None, help="epochs to train (default: the recipe's, with early stopping)")
parser.add_argument("--work", type=Path, default=cache / "python-example", help="where data, runs and the plot go")
args, _ = parser.parse_known_args()  # a notebook's kernel passes its own arguments
print(f"legend {legend.__version__}; working in {args.work}")

# %% [markdown]
# ## The data: UMLS's standard splits, imported into a dataset directory

# %%
raw = args.work / "raw" / "umls"
subprocess.run([root / "scripts" / "pykeen-graph.sh", "umls", raw], check=True)
dataset_dir = args.work / "datasets" / "umls"
if (dataset_dir / "dataset.toml").exists():
    dataset = legend.Dataset(dataset_dir)
else:
    dataset = legend.import_triples(dataset_dir, raw / "train.txt", raw / "valid.txt", raw / "test.txt")
print(dataset)
dataset.triples("train").head()

# %% [markdown]
# ## Training: the recipe in configs/umls-distmult.toml, in this process, with a progress bar
#
# Ctrl-C stops it at a checkpoint; `legend.train(out=run_dir, resume=True)` continues it.

# %%
run_dir = args.work / "runs" / "umls-distmult"
overrides = {"training.num_epochs": args.epochs} if args.epochs else {}
if (run_dir / "run.toml").exists():
    run = legend.train(out=run_dir, resume=True, overrides=overrides)
else:
    run = legend.train(dataset, run_dir, root / "configs" / "umls-distmult.toml", overrides)
print(run.result["split"], run.result["metrics"]["mrr"])
run.metrics()[["epoch", "loss", "edges_per_sec"]].tail()

# %% [markdown]
# ## Questions: what does a disease cause, what causes it

# %%
best = run.best() or run  # the best validated epoch's tables, when the recipe kept them
# What a virus causes that the data does not say (known triples filtered out) ...
print(best.predict(head="virus", relation="causes", k=5))
# ... and what causes disease, known causes included.
print(best.predict(tail="disease_or_syndrome", relation="causes", k=5, filtered=False))
print(best.score([("virus", "causes", "disease_or_syndrome"), ("virus", "causes", "plant")]))

# %% [markdown]
# ## Nearest neighbours, and where they sit among all entities (a 2-D projection)

# %%
entity = "virus"
near = best.neighbors(entity, k=8, metric="cosine")
print(near[["neighbor_label", "score"]])

vectors = best.embeddings()  # (135, 200) float32, memory-mapped from the checkpoint
centred = vectors - vectors.mean(axis=0)
_, _, axes = np.linalg.svd(centred, full_matrices=False)
xy = centred @ axes[:2].T

try:
    import matplotlib

    if not os.environ.get("DISPLAY"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib)")
else:
    fig, ax = plt.subplots(figsize=(7, 6))
    ax.scatter(xy[:, 0], xy[:, 1], s=8, color="0.75", label="entities")
    ids = near["neighbor_id"].to_numpy()
    ax.scatter(xy[ids, 0], xy[ids, 1], s=24, color="tab:blue", label=f"8 nearest ({near.attrs['metric']})")
    me = best.entity_id(entity)
    ax.scatter(xy[me, 0], xy[me, 1], s=60, color="tab:red", label=entity)
    for i, label in zip(ids, near["neighbor_label"]):
        ax.annotate(label, xy[i], fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_title(f"UMLS DistMult: the nearest neighbours of {entity}")
    ax.set_xlabel("first principal component")
    ax.set_ylabel("second principal component")
    ax.legend(loc="best", fontsize=8)
    plot = args.work / "neighbours.png"
    fig.savefig(plot, dpi=120, bbox_inches="tight")
    print(f"plot: {plot}")
    if "ipykernel" not in sys.modules:
        plt.close(fig)
