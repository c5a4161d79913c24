"""Every example of the tutorial "Attention: the core of the Transformer", run on attnkit.

    python examples/tutorial.py [--out DIR]

The tutorial's own definitions are replaced by one import, ``from attnkit.tutorial
import *``; the examples below call its names with its signatures, in its order.
Prints the shapes of each step and writes the heatmap to DIR/attention.png.
"""

# ruff: noqa: F403, F405  (the star import is the point: the tutorial's names, one line)
import argparse
import math
from pathlib import Path

import torch

from attnkit.tutorial import *


def section(title):
    print(f"\n== {title} ==")


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--out", type=Path, default=Path("attention"), help="folder for attention.png (default: attention/)"
)
args = parser.parse_args()
torch.manual_seed(0)

section("1. Scaled dot-product attention: softmax(QK^T / sqrt(d_k)) V")
batch_size = 2
num_heads = 8
seq_len = 10
d_k = 64
Q = torch.randn(batch_size, num_heads, seq_len, d_k)
K = torch.randn(batch_size, num_heads, seq_len, d_k)
V = torch.randn(batch_size, num_heads, seq_len, d_k)
output, attention = scaled_dot_product_attention(Q, K, V)
print(f"Output shape: {output.shape}")
print(f"Attention shape: {attention.shape}")
by_hand = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(d_k), dim=-1) @ V
print(f"same as softmax(QK^T / sqrt(d_k)) V: {torch.allclose(output, by_hand, atol=1e-5)}")

section("2. Multi-head attention: W_q, W_k, W_v, split heads, attend, merge, W_o")
d_model = num_heads * d_k
multi_head_attn = MultiHeadAttention(d_model, num_heads, dropout=0.1).eval()
x = torch.randn(batch_size, seq_len, d_model)
print(f"d_model={multi_head_attn.d_model}, num_heads={multi_head_attn.num_heads}, d_k={multi_head_attn.d_k}")
print(f"W_q: {multi_head_attn.W_q}")
heads = multi_head_attn.split_heads(multi_head_attn.W_q(x), batch_size)
print(f"input:       {tuple(x.shape)}")
print(f"split heads: {tuple(heads.shape)}  (batch, heads, seq, d_k)")
out, attention_weights = multi_head_attn(x, x, x)
print(f"output:      {tuple(out.shape)}")
print(f"weights:     {tuple(attention_weights.shape)}  (batch, heads, seq_q, seq_k)")

section("3. Padding mask (True = real token)")
seq = torch.tensor([[1, 2, 3, 0, 0], [1, 2, 0, 0, 0]])
padding_mask = create_padding_mask(seq)
print(padding_mask)

section("4. Causal mask (True = may attend: the lower triangle)")
causal_mask = create_causal_mask(5)
print(causal_mask.int())
output, attention = causal_mask_attention(Q, K, V)
same, _ = scaled_dot_product_attention(Q, K, V, create_causal_mask(seq_len))
print(
    f"causal_mask_attention: {tuple(output.shape)}; same as the causal mask: {torch.allclose(output, same, atol=1e-6)}"
)
print(f"nothing after the diagonal: {bool((attention.triu(1) == 0).all())}")
both = padding_mask & causal_mask  # (B, 1, 1, L) & (L, L) -> (B, 1, L, L)
print(f"padding & causal: {tuple(both.shape)}; sequence 1:\n{both[1, 0].int()}")
emb = torch.randn(2, 5, d_model)
out, w = multi_head_attn(emb, emb, emb, both)
print(f"masked output: {tuple(out.shape)}; no weight on padding: {bool((w[1, :, :, 2:] == 0).all())}")

section("5. Attention heatmap")
tokens = ["[CLS]", "今天", "天气", "很", "好", "[SEP]"]
attention_weights = attention[0]  # (8, 10, 10): the heads of a 10-position example
try:
    visualize_attention(attention_weights.unsqueeze(0), tokens, save_path=None)
except ValueError as err:
    print(f"10 positions with 6 tokens, as the tutorial passes them:\n  {err}")
emb = torch.randn(1, len(tokens), d_model)  # one position per token
_, attention_weights = multi_head_attn(emb, emb, emb)
path = args.out / "attention.png"
visualize_attention(attention_weights, tokens, save_path=str(path))  # (draws sample 0, head 0)
print(f"tokens: {tokens}")
print(f"wrote {path}")

section("6. Three kinds of attention")
mask = None
self_attn_output, _ = multi_head_attn(x, x, x, mask)
print(f"self-attention:          {tuple(self_attn_output.shape)}")
encoder_output = torch.randn(batch_size, 7, d_model)
decoder_output = torch.randn(batch_size, 5, d_model)
cross_attn_output, cross_weights = multi_head_attn(
    query=decoder_output,
    key=encoder_output,
    value=encoder_output,
    mask=None,
)
print(f"cross-attention:         {tuple(cross_attn_output.shape)}, weights {tuple(cross_weights.shape)}")
bidirectional_attn, _ = scaled_dot_product_attention(Q, K, V)
print(f"bidirectional attention: {tuple(bidirectional_attn.shape)}")
