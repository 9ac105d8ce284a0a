#!/usr/bin/env python3
"""PyTorch side of the GPU batch benchmark, and the summary table.

Measures the two ceilings (device-to-device copy bandwidth, TF32 matrix-product rate), then
times a straightforward PyTorch version of the same training step as legend-cuda's
batch_bench (B = 1e5 positives, 10 chunks x 1000 shared negatives per side, d = 100,
softmax cross-entropy, gather -> operator -> chunked matmuls -> logsumexp -> autograd ->
AdaGrad on the unique rows; TF32 on), and prints the table against legend-cuda's results
(the JSON lines file given as the first argument).
"""
import json
import sys

import torch

ENTITIES, RELATIONS, BATCH, CHUNKS, K, DIM = 1_000_000, 1_000, 100_000, 10, 1_000, 100
LR, EPS = 0.1, 1e-9


def timed(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def ceilings():
    x = torch.empty(1 << 28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    x.uniform_()
    ms = timed(lambda: y.copy_(x), reps=10)
    bandwidth = 2 * x.numel() * 4 / (ms * 1e-3)
    n = 8192
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    ms = timed(lambda: a @ b, reps=10)
    tf32 = 2 * n**3 / (ms * 1e-3)
    del x, y, a, b
    return bandwidth, tf32


def op(decoder, anchor, rel, side_dst):
    if decoder == "dot":
        return anchor
    h = DIM // 2
    ar, ai, rr, ri = anchor[..., :h], anchor[..., h:], rel[..., :h], rel[..., h:]
    if side_dst:
        return torch.cat([ar * rr - ai * ri, ar * ri + ai * rr], -1)
    return torch.cat([rr * ar + ri * ai, rr * ai - ri * ar], -1)


def step(decoder, emb, state, rel, rel_state, edges, negs):
    src, r, dst = edges[:, 0], edges[:, 1], edges[:, 2]
    ids = torch.cat([src, dst, negs.reshape(-1)])
    uniq, inv = torch.unique(ids, return_inverse=True)
    rows = emb[uniq].requires_grad_()
    b = BATCH // CHUNKS
    s_e = rows[inv[:BATCH]].view(CHUNKS, b, DIM)
    d_e = rows[inv[BATCH:2 * BATCH]].view(CHUNKS, b, DIM)
    n_e = rows[inv[2 * BATCH:]].view(CHUNKS, 2, K, DIM)
    if decoder == "dot":
        rr = None
    else:
        ru, rinv = torch.unique(r, return_inverse=True)
        rrows = rel[ru].requires_grad_()
        rr = rrows[rinv].view(CHUNKS, b, DIM)
    loss = 0.0
    for side_dst, anchor, truth, neg in ((True, s_e, d_e, n_e[:, 1]), (False, d_e, s_e, n_e[:, 0])):
        q = op(decoder, anchor, rr, side_dst)
        pos = (q * truth).sum(-1, keepdim=True)
        scores = torch.bmm(q, neg.transpose(1, 2))
        loss = loss + (torch.logsumexp(torch.cat([pos, scores], -1), -1) - pos.squeeze(-1)).sum()
    loss.backward()
    with torch.no_grad():
        g = rows.grad
        s = state[uniq] + g * g
        state[uniq] = s
        emb[uniq] -= LR * g / (s.sqrt() + EPS)
        if rr is not None:
            g = rrows.grad
            s = rel_state[ru] + g * g
            rel_state[ru] = s
            rel[ru] -= LR * g / (s.sqrt() + EPS)
    return loss


def torch_batch_ms(decoder):
    gen = torch.Generator(device="cuda").manual_seed(5)
    emb = (torch.rand(ENTITIES, DIM, device="cuda", generator=gen) - 0.5)
    rel = (torch.rand(RELATIONS, DIM, device="cuda", generator=gen) - 0.5)
    state, rel_state = torch.zeros_like(emb), torch.zeros_like(rel)
    batches = []
    for _ in range(4):
        e = torch.stack([
            torch.randint(0, ENTITIES, (BATCH,), device="cuda", generator=gen),
            torch.randint(0, RELATIONS, (BATCH,), device="cuda", generator=gen),
            torch.randint(0, ENTITIES, (BATCH,), device="cuda", generator=gen),
        ], 1)
        n = torch.randint(0, ENTITIES, (CHUNKS, 2, K), device="cuda", generator=gen)
        batches.append((e, n))
    it = [0]

    def one():
        e, n = batches[it[0] % len(batches)]
        it[0] += 1
        step(decoder, emb, state, rel, rel_state, e, n)

    return timed(one)


def main():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ours = []
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            ours = [json.loads(line) for line in f if line.strip()]
    bandwidth, tf32 = ceilings()
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"(read + write), TF32 matmul {tf32 / 1e12:.0f} TFLOP/s (8192^3)")
    torch_ms = {d: torch_batch_ms(d) for d in ("complex", "dot")}
    print()
    print("| decoder | group | legend-cuda ms | sample | step | PyTorch ms | PyTorch / ours "
          "| FLOP floor ms | byte floor ms | ours / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in ours:
        flop_floor = r["flops"] / tf32 * 1e3
        byte_floor = r["min_bytes"] / bandwidth * 1e3
        floor = max(flop_floor, byte_floor)
        t = torch_ms[r["decoder"]]
        print(f"| {r['decoder']} | {r['group']} | {r['median_ms']:.3f} | {r['sample_ms']:.3f} "
              f"| {r['step_ms']:.3f} | {t:.2f} | {t / r['median_ms']:.1f}x "
              f"| {flop_floor:.3f} | {byte_floor:.3f} | {r['median_ms'] / floor:.2f} |")
    if not ours:
        for d, t in torch_ms.items():
            print(f"| {d} | - | - | - | - | {t:.2f} | - | - | - | - |")


if __name__ == "__main__":
    main()
