"""Train ComplEx with PyTorch Geometric (`torch_geometric.nn.kge.ComplEx`) on a Legend dataset and
export the embeddings in Legend's id order and layout ([real | imaginary] rows, float32 .npy), for
`legendctl eval --embeddings`.

The training triples are Legend's own edges/train.bin, so PyG's node/relation ids ARE Legend's ids.

Two training modes:
  * --negatives 0 (default): PyG's own recipe, as in its examples: batches from `model.loader`
    (a shuffled DataLoader over the triples), loss `model.loss` = binary cross-entropy of each
    positive against ONE corruption of it (`random_sample`: the head for the first half of the
    batch, the tail for the second half);
  * --negatives K: `model.forward` on B·K gathered negative triples, K per positive (head
    corrupted for the first K/2 of each positive's negatives, tail for the rest, uniform ids),
    softmax cross-entropy of each positive against its K negatives (mean over the batch) —
    PyKEEN's sLCWA + CrossEntropyLoss, written out over PyG's score function.

Settings otherwise as pykeen_train.py: d real floats = d/2 complex dims (`hidden_channels`), score
Re(<h, r, conj(t)>), init entities N(0, init_scale) per real float and relations 1 + 0i (PyG's own
init is Xavier-uniform: replaced), torch.optim.Adagrad(lr) on dense embeddings (PyG's default
`sparse=False`), no regulariser. The epoch's loss is summed on the device and read once an epoch.
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
    write_embeddings,
    write_summary,
)


def main() -> None:
    ap = baseline_arguments(
        __doc__, 0, "0: PyG's model.loss (1 corruption, BCE); K: K negatives per positive, softmax CE", "cuda:0"
    )
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import torch_geometric
    from torch_geometric.nn.kge import ComplEx

    if args.dim % 2:
        sys.exit("--dim must be even (ComplEx: d/2 complex dims)")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    num_entities = len(read_tsv_ids(args.dataset / "entities.tsv"))
    num_relations = len(read_tsv_ids(args.dataset / "relations.tsv"))
    train = read_edges(args.dataset, "train")
    if args.limit_edges:
        train = train[: args.limit_edges]
    triples = torch.from_numpy(train).to(device)
    head, rel, tail = triples[:, 0], triples[:, 1], triples[:, 2]

    model = ComplEx(num_nodes=num_entities, num_relations=num_relations, hidden_channels=args.dim // 2).to(device)
    with torch.no_grad():
        torch.nn.init.normal_(model.node_emb.weight, std=args.init_scale)
        torch.nn.init.normal_(model.node_emb_im.weight, std=args.init_scale)
        model.rel_emb.weight.fill_(1.0)
        model.rel_emb_im.weight.zero_()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    loader = model.loader(head_index=head, rel_type=rel, tail_index=tail, batch_size=args.batch_size, shuffle=True)
    k = args.negatives

    def k_negatives_loss(h: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        pos = model(h, r, t)
        b = h.numel()
        nh, nr, nt = (x.repeat_interleave(k) for x in (h, r, t))
        rnd = torch.randint(num_entities, (b * k,), device=h.device)
        side = (torch.arange(b * k, device=h.device) % k) < k // 2  # True: head replaced
        nh = torch.where(side, rnd, nh)
        nt = torch.where(side, nt, rnd)
        neg = model(nh, nr, nt).view(b, k)
        logits = torch.cat([pos.unsqueeze(1), neg], dim=1)
        return F.cross_entropy(logits, torch.zeros(b, dtype=torch.long, device=h.device))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    epochs: list[dict] = []
    sync()
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t = time.perf_counter()
        total = torch.zeros((), device=device)
        for h, r, tl in loader:
            optimizer.zero_grad()
            loss = model.loss(h, r, tl) if k == 0 else k_negatives_loss(h, r, tl)
            loss.backward()
            optimizer.step()
            total += loss.detach() * h.numel()
        epoch_loss = float(total) / len(train)  # waits for the epoch's work
        seconds = time.perf_counter() - t
        rec = {"epoch": epoch, "loss": epoch_loss, "seconds": seconds, "edges_per_sec": len(train) / seconds}
        epochs.append(rec)
        print(json.dumps(rec), flush=True)
    train_s = time.perf_counter() - t0

    with torch.no_grad():
        ent = torch.cat([model.node_emb.weight, model.node_emb_im.weight], dim=1).cpu().numpy()
        rels = torch.cat([model.rel_emb.weight, model.rel_emb_im.weight], dim=1).cpu().numpy()
        probe = triples[:64]
        theirs = model(probe[:, 0], probe[:, 1], probe[:, 2]).double().cpu().numpy()
    check_export("PyG", theirs, ent, rels, train[:64])
    write_embeddings(args.out, ent, rels)
    loss_name = "model.loss (1 corruption, BCE)" if k == 0 else f"forward, {k} negatives, softmax CE"
    settings = vars(args) | {"dataset": str(args.dataset), "out": str(args.out)}
    write_summary(args.out, f"PyG {torch_geometric.__version__} kge.ComplEx, {loss_name} (torch {torch.__version__}, {device})", epochs, train_s, int(len(train)), settings)


if __name__ == "__main__":
    main()
