"""Every example of the tutorial "Attention: the core of the Transformer", run on attnkit.

    python examples/tutorial.py [--out DIR]

Prints the shapes of each step and writes the heatmap to DIR/attention.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import attnkit
from attnkit import masks


def section(title: str) -> None:
    print(f"\n== {title} ==")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for attention.png")
    args = parser.parse_args()
    torch.manual_seed(0)

    section("1. Scaled dot-product attention: softmax(QK^T / sqrt(d_k)) V")
    batch, seq_len, d_k = 2, 4, 8
    Q, K, V = (torch.randn(batch, seq_len, d_k) for _ in range(3))
    output, weights = attnkit.scaled_dot_product_attention(Q, K, V)
    print(f"Q, K, V: {tuple(Q.shape)}")
    print(f"output:  {tuple(output.shape)}")
    print(f"weights: {tuple(weights.shape)}  (each row sums to {weights[0, 0].sum():.1f})")

    section("2. Multi-head attention: split heads, attend, merge heads")
    d_model, num_heads, seq_len = 512, 8, 10
    mha = attnkit.MultiHeadAttention(d_model, num_heads, dropout=0.1).eval()
    x = torch.randn(batch, seq_len, d_model)
    heads = mha.split_heads(mha.q_proj(x), num_heads)
    print(f"input:        {tuple(x.shape)}")
    print(f"split heads:  {tuple(heads.shape)}  (B, H, L, d_model / H)")
    out, w = mha(x, x, x, need_weights=True)
    print(f"output:       {tuple(out.shape)}")
    print(f"weights:      {tuple(w.shape)}  (B, H, Lq, Lk)")

    section("3. Padding mask (True = real token)")
    seq = torch.tensor([[5, 7, 9, 0, 0], [3, 4, 0, 0, 0]])
    padding_mask = attnkit.create_padding_mask(seq, pad_idx=0)
    print(f"sequences:    {seq.tolist()}")
    print(f"padding mask: {tuple(padding_mask.shape)}\n{padding_mask.int()[:, 0, 0]}")

    section("4. Causal mask (True = may attend: the lower triangle)")
    causal_mask = attnkit.create_causal_mask(5)
    print(causal_mask.int())
    both = padding_mask & causal_mask  # (B, 1, 1, L) & (L, L) -> (B, 1, L, L)
    print(f"padding & causal: {tuple(both.shape)}; sequence 1:\n{both[1, 0].int()}")
    emb = torch.randn(2, 5, 64)
    mha64 = attnkit.MultiHeadAttention(64, 4).eval()
    out, _ = mha64(emb, emb, emb, mask=both)
    same, _ = mha64(emb, emb, emb, mask=masks.padding(torch.tensor([3, 2])) & masks.causal())
    print(f"masked output: {tuple(out.shape)}; same as the mask objects: {torch.allclose(out, same, atol=1e-6)}")

    section("5. Three kinds of attention")
    src = torch.randn(2, 7, 64)  # encoder input
    tgt = torch.randn(2, 5, 64)  # decoder input
    bidirectional, _ = mha64(src, src, src)  # every token sees every token
    print(f"bidirectional self-attention (encoder): {tuple(bidirectional.shape)}")
    causal_self, _ = mha64(tgt, tgt, tgt, mask=masks.causal())  # each token sees its past
    print(f"causal self-attention (decoder):        {tuple(causal_self.shape)}")
    cross, cross_w = mha64(tgt, src, src, need_weights=True)  # decoder queries, encoder keys/values
    print(f"cross-attention (decoder -> encoder):   {tuple(cross.shape)}, weights {tuple(cross_w.shape)}")

    section("6. Attention heatmap")
    tokens = ["[CLS]", "今天", "天气", "很", "好", "[SEP]"]
    emb = torch.randn(1, len(tokens), 64)
    _, w = mha64(emb, emb, emb, need_weights=True)
    path = args.out / "attention.png"
    attnkit.visualize_attention(w[0, 0], tokens, save_path=path, title="head 0")
    print(f"tokens: {tokens}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
