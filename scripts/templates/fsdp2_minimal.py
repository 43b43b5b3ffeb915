"""Minimal FSDP2 training. Run: torchrun --standalone --nproc-per-node N fsdp2_minimal.py"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 3
CHECKPOINT = sys.argv[1] if len(sys.argv) > 1 else "fsdp2_minimal.pt"  # where to save


@record  # on a crash, torchrun's summary shows this rank's traceback
def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun: this node's process index
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # without it, every rank's "cuda" is GPU 0
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # one shard per rank

    torch.manual_seed(0)  # the same data and initial weights on every rank (FSDP broadcasts none)
    inputs = torch.randn(256, 16)
    dataset = TensorDataset(inputs, inputs[:, :4].sum(dim=1, keepdim=True))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # a shard per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)  # 16 per rank

    model = nn.Sequential(nn.Sequential(nn.Linear(16, 64), nn.ReLU()),
                          nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                          nn.Linear(64, 1)).to(device)
    for block in model[:2]:
        fully_shard(block, mesh=mesh)  # each block: gathered only while it computes
    fully_shard(model, mesh=mesh)  # the root takes the rest (the head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # after sharding

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # reduce-scatter: each rank gets its shard's mean gradient
            optimizer.step()  # each rank updates its own shard
        if rank == 0:
            print(f"epoch {epoch}: loss of rank 0's last batch {loss.item():.4f}")

    # One full file, as the FSDP2 tutorial saves (too big for one host? dcp.save, per-rank shards)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # a collective: on every rank
    if rank == 0:
        temporary = CHECKPOINT + ".tmp"
        torch.save({"model": state, "epochs": EPOCHS}, temporary)
        os.replace(temporary, CHECKPOINT)  # atomic: never a half-written checkpoint
    dist.barrier()  # no rank leaves before the checkpoint exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # gloo: free the group that DDP/FSDP hold in cycles before Python shuts down
