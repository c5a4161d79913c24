"""Ring attention on two processes: `torchrun --nproc-per-node 2 examples/ring.py`.

Every rank builds the same random sequence (in a real model each rank would only
ever hold its part), keeps its zigzag part, and attends over the whole sequence with
a packed-documents causal mask. Rank 0 checks the result against one process.
"""

import torch
import torch.distributed as dist

import attnkit
from attnkit import distributed, masks


def main():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")

    g = torch.Generator().manual_seed(0)
    length = 4099  # need not divide the number of ranks
    q = torch.randn(1, 8, length, 64, generator=g).to(device)
    k = torch.randn(1, 2, length, 64, generator=g).to(device)  # grouped-query attention: 2 K/V heads
    v = torch.randn(1, 2, length, 64, generator=g).to(device)
    doc_ids = torch.repeat_interleave(torch.arange(8), torch.tensor([700, 300, 900, 99, 1000, 400, 500, 200]))
    mask = masks.document(doc_ids) & masks.causal()

    q_local, positions = distributed.shard(q, dim=2)  # positions: for a rotary embedding
    k_local, _ = distributed.shard(k, dim=2)
    v_local, _ = distributed.shard(v, dim=2)
    out_local = distributed.ring_attention(q_local, k_local, v_local, mask)
    out = distributed.unshard(out_local, dim=2)

    if rank == 0:
        print(distributed.explain(mask, length, world_size=world))
        error = (out - attnkit.attention(q, k, v, mask)).abs().max().item()
        print(f"rank 0 holds positions {positions[:3].tolist()}...; max |ring - one process| = {error:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
