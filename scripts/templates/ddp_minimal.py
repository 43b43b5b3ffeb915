"""Minimal DDP training. Run: torchrun --standalone --nproc-per-node N ddp_minimal.py"""

import gc
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 3
CHECKPOINT = sys.argv[1] if len(sys.argv) > 1 else "ddp_minimal.pt"  # where to save


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

    torch.manual_seed(0)  # the same data and initial weights on every rank
    inputs = torch.randn(256, 16)
    dataset = TensorDataset(inputs, inputs[:, :4].sum(dim=1, keepdim=True))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # a shard per rank
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)  # 16 per rank

    model = nn.Sequential(nn.Sequential(nn.Linear(16, 64), nn.ReLU()),
                          nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                          nn.Linear(64, 1)).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch}: loss of rank 0's last batch {loss.item():.4f}")

    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank}: weights {digest}")  # every replica prints the same
    if rank == 0:  # the replicas are identical: one writes, to a temporary file first
        temporary = CHECKPOINT + ".tmp"
        torch.save({"model": model.module.state_dict(), "epochs": EPOCHS}, temporary)
        os.replace(temporary, CHECKPOINT)  # atomic: never a half-written checkpoint
    dist.barrier()  # no rank leaves before the checkpoint exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # gloo: free the group that DDP/FSDP hold in cycles before Python shuts down
