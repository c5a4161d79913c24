"""attention-gym's catalogue of mask_mods (``attn_gym.masks``), each at a chosen length: the
tests of ``attnkit.flex`` (tests/integrations/test_flex.py) and of predicate block maps
(tests/test_predicate_blocks.py) run every entry. Import only where attention-gym is installed."""

from __future__ import annotations

import torch
from attn_gym import masks as M  # noqa: N812 - attention-gym's own spelling


def catalogue(L: int = 256) -> dict:  # noqa: N803 - the length as FlexAttention names it
    """name -> maker of ``(mask_mod, Q_LEN, KV_LEN[, B, H])`` over sequences of ``L`` (a multiple of 64,
    at least 256); ``B`` and ``H`` where the mask_mod reads ``b`` and ``h``."""
    side = int(round(L**0.5)) if round(L**0.5) ** 2 == L else 16  # natten's canvas: the whole sequence where square

    def offsets(*cuts):
        return torch.tensor([0, *cuts, L], dtype=torch.int32)

    def vsa():
        """VSA's per-(sequence, head) top-k tiles, from its own coarse scores: a map per head."""
        torch.manual_seed(1)
        qq, kk = torch.randn(2, 4, L, 16), torch.randn(2, 4, L, 16)
        topk = M.compute_vsa_topk_indices(qq, kk, tile_numel=64, top_k=2)
        return M.generate_vsa_mask_mod(topk, tile_numel=64), L, L, 2, 4

    def jetspec_tree():
        ancestors = M.build_tree_ancestor_matrix([-1, 0, 0, 1, 1, 2, 2, 3] * 4, device="cpu")
        nodes = ancestors.shape[0]  # queries: the tree's nodes; keys: a prefix, then the nodes
        return M.generate_jetspec_tree_causal_mask_mod(L - nodes, ancestors), nodes, L

    scale = L // 256  # the documents and windows of the 256-token catalogue, stretched
    return {
        "causal": lambda: (M.causal_mask, L, L),
        "sliding_window": lambda: (M.generate_sliding_window(48 * scale), L, L),
        "prefix_lm": lambda: (M.generate_prefix_lm_mask(70 * scale), L, L),
        "document": lambda: (M.generate_doc_mask_mod(M.causal_mask, offsets(70 * scale, 180 * scale)), L, L),
        "packed_causal_document": lambda: (
            M.generate_packed_causal_doc_mask_mod(offsets(50 * scale, 130 * scale, 200 * scale)),
            L,
            L,
        ),
        "dilated_sliding_window": lambda: (M.generate_dilated_sliding_window(64 * scale, 2), L, L),
        "global_sliding_window": lambda: (
            M.generate_global_sliding_window(32 * scale, torch.arange(L) % 97 == 0),
            L,
            L,
        ),
        "natten": lambda: (M.generate_natten(side, L // side, 5, 5), L, L),
        "tiled_natten": lambda: (M.generate_tiled_natten(side, L // side, 5, 5, 4, 4), L, L),
        "morton_natten": lambda: (M.generate_morton_natten(side, L // side, 5, 5), L, L),
        "block_diffusion": lambda: (M.generate_block_diffusion_mask(L // 2, 16), L, L),
        "vision_cross_attention": lambda: (
            M.generate_vision_cross_attention_mask_mod(
                torch.tensor([[0, 100 * scale], [60 * scale, 200 * scale], [150 * scale, L]]), 64
            ),
            L,
            3 * 64,
        ),
        "jetspec_training": lambda: (M.generate_jetspec_training_mask_mod(96, 16), L - 96, L),
        "jetspec_tree_causal": jetspec_tree,
        "shared_prefix": lambda: (
            # documents 1 and 2 continue document 0 (their shared prefix); 3 continues itself
            M.generate_shared_prefix_mask_mod(
                offsets(60 * scale, 150 * scale, 200 * scale), torch.tensor([0, 0, 0, 3], dtype=torch.int32)
            ),
            L,
            L,
        ),
        "sta_2d": lambda: (M.generate_sta_mask_mod_2d((side, L // side), (8, 8), (4, 4)), L, L),
        "sta_3d": lambda: (M.generate_sta_mask_mod_3d((4, 8, L // 32), (2, 4, 4), (2, 4, 4)), L, L),
        "svg_spatial_head": lambda: (M.generate_spatial_head_mask_mod(16, L // 64, 60, 1, round_width=16), L, L),
        "svg_temporal_head": lambda: (M.generate_temporal_head_mask_mod(16, L // 64, 60, 1), L, L),
        "batchify": lambda: (M.batchify_mask_mod(M.causal_mask, 100 * scale), L, L),
        "vsa": vsa,
    }
