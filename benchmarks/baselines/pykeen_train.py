"""Train ComplEx with PyKEEN (sLCWA) on a Legend dataset and export the embeddings in Legend's
id order and layout ([real | imaginary] rows, float32 .npy), for `legendctl eval --embeddings`.

The training triples are Legend's own edges/train.bin, so PyKEEN's entity/relation ids ARE
Legend's ids: no relabelling is needed on export.

Settings mirror `legendctl train` as closely as PyKEEN allows:
  * ComplEx, d real floats = d/2 complex dims (PyKEEN's embedding_dim counts complex dims),
    score Re(<h, r, conj(t)>) (PyKEEN's ComplExInteraction, same as Legend's);
  * no regulariser (PyKEEN's ComplEx default adds an L2 one: switched off);
  * init: entities N(0, init_scale) per real float, relations 1 + 0i (Legend's/PBG's init);
  * loss: pykeen.losses.CrossEntropyLoss = softmax cross-entropy of the positive against its
    K sampled negatives (mean over the batch);
  * negatives: BasicNegativeSampler, K uniform negatives per positive, drawn independently for
    every positive (no sharing), each positive corrupted on ONE side (PyKEEN corrupts the heads of
    the first half of a batch's negatives and the tails of the second half);
  * optimizer: torch.optim.Adagrad(lr), elementwise, dense (eps 1e-10).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from legend_common import read_edges, read_tsv_ids, threads_env, write_embeddings  # noqa: E402


def dim2complex(rows: np.ndarray) -> np.ndarray:
    """Legend layout [re | im] -> complex."""
    half = rows.shape[1] // 2
    return rows[:, :half].astype(np.float64) + 1j * rows[:, half:].astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", type=Path, required=True, help="Legend dataset dir (legendctl import)")
    ap.add_argument("--out", type=Path, required=True, help="output dir: entities.npy, relations.npy, train.json")
    ap.add_argument("--dim", type=int, default=200, help="real floats per row (Legend's model.dim)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--negatives", type=int, default=1000, help="negatives per positive")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--init-scale", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-edges", type=int, default=0, help="train on the first N edges only (probing)")
    args = ap.parse_args()

    threads_env(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from pykeen.losses import CrossEntropyLoss
    from pykeen.models import ComplEx
    from pykeen.training import SLCWATrainingLoop
    from pykeen.training.callbacks import TrainingCallback
    from pykeen.triples import CoreTriplesFactory
    from pykeen.version import get_version

    if args.dim % 2:
        sys.exit("--dim must be even (ComplEx: d/2 complex dims)")
    num_entities = len(read_tsv_ids(args.dataset / "entities.tsv"))
    num_relations = len(read_tsv_ids(args.dataset / "relations.tsv"))
    train = read_edges(args.dataset, "train")
    if args.limit_edges:
        train = train[: args.limit_edges]
    tf = CoreTriplesFactory.create(
        mapped_triples=torch.from_numpy(train), num_entities=num_entities, num_relations=num_relations
    )

    scale = args.init_scale

    def init_entities(x: torch.Tensor) -> torch.Tensor:
        # x: real view (n, d/2, 2) of the complex table
        return torch.nn.init.normal_(x, mean=0.0, std=scale)

    def init_relations(x: torch.Tensor) -> torch.Tensor:
        x = torch.zeros_like(x)
        x[..., 0] = 1.0  # 1 + 0i
        return x

    model = ComplEx(
        triples_factory=tf,
        embedding_dim=args.dim // 2,
        entity_initializer=init_entities,
        relation_initializer=init_relations,
        regularizer=None,
        loss=CrossEntropyLoss(reduction="mean"),
        random_seed=args.seed,
    )
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    loop = SLCWATrainingLoop(
        model=model,
        triples_factory=tf,
        optimizer=optimizer,
        negative_sampler="basic",
        negative_sampler_kwargs=dict(num_negs_per_pos=args.negatives),
    )

    epochs: list[dict] = []

    class EpochLog(TrainingCallback):
        def __init__(self) -> None:
            super().__init__()
            self.t = time.perf_counter()

        def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
            now = time.perf_counter()
            rec = {
                "epoch": epoch,
                "loss": float(epoch_loss),
                "seconds": now - self.t,
                "edges_per_sec": len(train) / (now - self.t),
            }
            self.t = now
            epochs.append(rec)
            print(json.dumps(rec), flush=True)

    t0 = time.perf_counter()
    loop.train(
        triples_factory=tf,
        num_epochs=args.epochs,
        batch_size=args.batch_size,
        use_tqdm=False,
        use_tqdm_batch=False,
        callbacks=[EpochLog()],
        pin_memory=False,
    )
    train_s = time.perf_counter() - t0

    with torch.no_grad():
        ent = model.entity_representations[0](indices=None)  # complex (n, d/2)
        rel = model.relation_representations[0](indices=None)
        assert ent.is_complex() and rel.is_complex()
        ent_np = torch.cat([ent.real, ent.imag], dim=-1).numpy()
        rel_np = torch.cat([rel.real, rel.imag], dim=-1).numpy()
        # Self-check of the conversion: PyKEEN's own scores == Legend's formula on the exported rows.
        probe = torch.from_numpy(train[:64])
        theirs = model.score_hrt(probe).flatten().numpy()
        h = dim2complex(ent_np[train[:64, 0]])
        r = dim2complex(rel_np[train[:64, 1]])
        t = dim2complex(ent_np[train[:64, 2]])
        ours = np.real((h * r * np.conj(t)).sum(axis=1))
        if not np.allclose(theirs, ours, rtol=1e-4, atol=1e-6):
            sys.exit(f"export check failed: PyKEEN {theirs[:4]} vs Legend layout {ours[:4]}")
    write_embeddings(args.out, ent_np, rel_np)
    summary = {
        "system": f"PyKEEN {get_version()} (torch {torch.__version__}, {torch.get_num_threads()} threads)",
        "epochs": epochs,
        "train_s": train_s,
        "train_edges": int(len(train)),
        "settings": vars(args) | {"dataset": str(args.dataset), "out": str(args.out)},
    }
    (args.out / "train.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"final": True, "train_s": train_s}), flush=True)


if __name__ == "__main__":
    main()
