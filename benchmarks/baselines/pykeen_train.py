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
  * optimizer: torch.optim.Adagrad(lr), elementwise, dense (eps 1e-10);
  * --device: cpu (default) or cuda:N (the model and its training on that GPU; PyKEEN's loader
    still draws the negatives on the CPU); epoch times are taken after the device has finished.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from legend_common import (  # noqa: E402
    baseline_arguments,
    check_export,
    read_edges,
    read_tsv_ids,
    threads_env,
    write_embeddings,
    write_summary,
)


def main() -> None:
    ap = baseline_arguments(__doc__, 1000, "negatives per positive", "cpu")
    ap.add_argument("--threads", type=int, default=2)
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
    ).to(args.device)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    loop = SLCWATrainingLoop(
        model=model,
        triples_factory=tf,
        optimizer=optimizer,
        negative_sampler="basic",
        negative_sampler_kwargs=dict(num_negs_per_pos=args.negatives),
        # The batch is given and fits: no probing for sub-batch sizes (on a GPU it would train
        # trial batches before the first epoch).
        automatic_memory_optimization=False,
    )

    epochs: list[dict] = []

    class EpochLog(TrainingCallback):
        def __init__(self) -> None:
            super().__init__()
            self.t = time.perf_counter()

        def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
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
        pin_memory=model.device.type == "cuda",  # PyKEEN's default on a GPU
    )
    train_s = time.perf_counter() - t0

    with torch.no_grad():
        ent = model.entity_representations[0](indices=None)  # complex (n, d/2)
        rel = model.relation_representations[0](indices=None)
        assert ent.is_complex() and rel.is_complex()
        ent_np = torch.cat([ent.real, ent.imag], dim=-1).cpu().numpy()
        rel_np = torch.cat([rel.real, rel.imag], dim=-1).cpu().numpy()
        # Self-check of the conversion: PyKEEN's own scores == Legend's formula on the exported rows.
        probe = torch.from_numpy(train[:64]).to(model.device)
        theirs = model.score_hrt(probe).flatten().double().cpu().numpy()
    check_export("PyKEEN", theirs, ent_np, rel_np, train[:64])
    write_embeddings(args.out, ent_np, rel_np)
    where = str(model.device) if model.device.type == "cuda" else f"{torch.get_num_threads()} threads"
    settings = vars(args) | {"dataset": str(args.dataset), "out": str(args.out)}
    write_summary(args.out, f"PyKEEN {get_version()} (torch {torch.__version__}, {where})", epochs, train_s, int(len(train)), settings)


if __name__ == "__main__":
    main()
