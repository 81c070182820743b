"""Rotation and multiplication counts of BLB's fused ct-ct MatMul (paper section 5, Appendix
C.1; cipherlm/protocols/ckks/blb_matmul.py) next to the BOLT and Powerformer models and the
paper's Table 7, for BERT-base (128 tokens, 12 heads, head dim 64) and Table 7's shapes; then
the output projection on P V's diagonal packing (Appendix C.2;
cipherlm/protocols/ckks/blb_diag_matmul.py).

Pure Python (no HE): `counts` is the exact prediction of what `fused_matmul` / `outproj`
perform, checked against Lattigo's counters in tests/test_blb_matmul.py and
tests/test_blb_attention.py.  Prints two markdown tables (the ones in docs/blb.md, "Fused
ct-ct MatMul (section 5)" and "Output projection (Appendix C.2)").

    .venv/bin/python benchmarks/blb_matmul_counts.py
"""

from __future__ import annotations

from cipherlm.protocols.ckks import blb_diag_matmul as C2
from cipherlm.protocols.ckks import blb_matmul as M

SHAPES = [  # model, tokens, heads, head dim
    ("BERT-base", 128, 12, 64),
    ("BERT-large", 128, 16, 64),
    ("GPT2-base", 64, 12, 64),
]
SLOTS = (8192, 16384)  # N = 16384 (Table 6: the Q K^T block), N = 32768 (the P V block)


def rows():
    for model, n, heads, hd in SHAPES:
        paper = M.TABLE7.get((model, n, heads, hd))
        bolt, pf = M.bolt_counts(n, heads, hd), M.powerformer_counts(n, heads, hd)
        for op, k in (("Q K^T", hd), ("P V", n)):
            t7 = None if paper is None else {m: v[0 if op == "Q K^T" else 1] for m, v in paper.items()}
            for slots in SLOTS:
                naive = M.counts(slots, heads, n, k, bsgs=False)
                blb = M.counts(slots, heads, n, k)
                yield dict(model=model, op=op, n=n, heads=heads, hd=hd, slots=slots, naive=naive, blb=blb,
                           bolt=bolt, pf=pf, t7=t7)


def fmt(c: dict) -> str:
    return f"{c['rotate']} / {c['mul']} / {c['mul_plain']}"


def main() -> None:
    print("| model (tokens, heads, head dim) | op | slots | c, J | BLB naive rot | BLB BSGS rot / ct-ct / ct-pt "
          "(beta x gamma, depth) | BOLT model rot / ct-ct / ct-pt | Powerformer model rot / ct-ct / ct-pt | "
          "Table 7 rot: BOLT / Powerformer / BLB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows():
        b = r["blb"]
        t7 = "-" if r["t7"] is None else f"{r['t7']['BOLT']} / {r['t7']['Powerformer']} / {r['t7']['BLB']}"
        print(f"| {r['model']} ({r['n']}, {r['heads']}, {r['hd']}) | {r['op']} | {r['slots']} | "
              f"{b['groups']}, {b['cts']} | {r['naive']['rotate']} | {fmt(b)} ({b['baby']} x {b['giant']}, "
              f"{b['depth']}) | {fmt(r['bolt'])} | {fmt(r['pf'])} | {t7} |")


def outproj_rows():
    for model, n, heads, hd in SHAPES:
        d_model = heads * hd
        for slots in SLOTS:
            lo = C2.make_diag_layout(M.make_layout(slots, heads, n, n), hd, d_model)
            sparse = C2.make_diag_layout(lo.pv, hd, d_model, dense=False)
            s = slots // n  # columns per spatial-first ciphertext
            ref = -(-d_model // s) * -(-d_model // s) * s  # the same diagonal method on H d_h dense columns
            yield dict(model=model, n=n, heads=heads, hd=hd, slots=slots, lo=lo, naive=C2.counts(lo, False),
                       blb=C2.counts(lo), sparse=C2.counts(sparse), ref=ref)


def main_outproj() -> None:
    print("| model (tokens, heads, head dim) -> D | slots | c, J_in (dense), M | all-baby rot | BSGS rot / ct-pt "
          "(beta x gamma, depth) | without Figure 15 (b): BSGS rot / ct-pt | spatial-first reference ct-pt |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in outproj_rows():
        b, lo = r["blb"], r["lo"]
        print(f"| {r['model']} ({r['n']}, {r['heads']}, {r['hd']}) -> {r['heads'] * r['hd']} | {r['slots']} | "
              f"{lo.pv.groups}, {lo.n_in}{' (dense)' if lo.dense else ''}, {lo.n_out} | {r['naive']['rotate']} | "
              f"{b['rotate']} / {b['mul_plain']} ({b['baby']} x {b['giant']}, {b['depth']}) | "
              f"{r['sparse']['rotate']} / {r['sparse']['mul_plain']} | {r['ref']} |")


if __name__ == "__main__":
    main()
    print()
    main_outproj()
