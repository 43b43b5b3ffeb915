"""Chapter 03: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist
from torch.distributed import isend


def ring_all_reduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(tensor.tensor_split(world))

    def exchange(send, receive):
        incoming = torch.empty_like(chunks[receive])
        if rank % 2 == 0:  # blocking calls: half the ring sends first
            dist.send(chunks[send], right)
            dist.recv(incoming, left)
        else:
            dist.recv(incoming, left)
            dist.send(chunks[send], right)
        return incoming

    for step in range(world - 1):
        receive = (rank - step - 1) % world
        chunks[receive] += exchange((rank - step) % world, receive)
    for step in range(world - 1):
        receive = (rank - step) % world
        chunks[receive].copy_(exchange((rank - step + 1) % world, receive))


def reduce_scatter(output, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = [chunk.clone() for chunk in tensor.chunk(world)]
    for step in range(world - 1):
        send, receive = (rank - step - 1) % world, (rank - step - 2) % world
        incoming = torch.empty_like(chunks[receive])
        request = dist.isend(chunks[send], right)
        dist.recv(incoming, left)
        request.wait()
        chunks[receive] += incoming
    output.copy_(chunks[rank])


def crossover_bytes(alpha, bandwidth, world):
    return alpha * bandwidth * world


# Plausible mistakes -------------------------------------------------------------------

def ring_all_reduce_everyone_sends_first(tensor):
    """Blocking sends on every rank at once: each waits for a receive no one posts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.tensor_split(world))
    for step in range(world - 1):
        receive = (rank - step - 1) % world
        incoming = torch.empty_like(chunks[receive])
        dist.send(chunks[(rank - step) % world], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        chunks[receive] += incoming


def ring_all_reduce_without_all_gather(tensor):
    """Stops after the reduce-scatter: each rank holds only one chunk of the sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.tensor_split(world))
    for step in range(world - 1):
        receive = (rank - step - 1) % world
        incoming = torch.empty_like(chunks[receive])
        request = dist.isend(chunks[(rank - step) % world], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        chunks[receive] += incoming


def ring_all_reduce_with_a_collective(tensor):
    """Correct sums, but not built from messages."""
    dist.all_reduce(tensor)


def reduce_scatter_off_by_one(output, tensor):
    """Ends with the neighbour's chunk of the sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = [chunk.clone() for chunk in tensor.chunk(world)]
    for step in range(world - 1):
        send, receive = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[receive])
        request = dist.isend(chunks[send], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        chunks[receive] += incoming
    output.copy_(chunks[(rank + 1) % world])


def ring_all_reduce_that_raises(tensor):
    """A mistake that raises inside the ranks: the chunk list indexed past its end."""
    world = dist.get_world_size()
    chunks = list(tensor.tensor_split(world))
    chunks[world] += 1


def ring_all_reduce_to_every_rank(tensor):
    """Right sums without a ring: every rank sends its whole tensor to every other."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tensor.clone()
    requests = [dist.isend(mine, peer) for peer in range(world) if peer != rank]
    for peer in range(world):
        if peer != rank:
            incoming = torch.empty_like(mine)
            dist.recv(incoming, peer)
            tensor += incoming
    for request in requests:
        request.wait()


def reduce_scatter_from_every_rank(output, tensor):
    """Right chunk without a ring: every rank sends its whole tensor to every other."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    requests = [dist.isend(tensor, peer) for peer in range(world) if peer != rank]
    for peer in range(world):
        if peer != rank:
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, peer)
            total += incoming
    for request in requests:
        request.wait()
    output.copy_(total.chunk(world)[rank])


def crossover_bytes_without_world(alpha, bandwidth, world):
    """Forgets that each rank sends only 2(N-1)/N of the tensor."""
    return alpha * bandwidth


def crossover_bytes_nan(alpha, bandwidth, world):
    """0 / 0 somewhere on the way: nan."""
    return float("nan")


# Other correct solutions --------------------------------------------------------------

def ring_all_reduce_batched(tensor):
    """The ring with batch_isend_irecv: each step's send and receive as one batch of
    P2POps, built from the isend that the module imported (not dist.isend)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(tensor.tensor_split(world))

    def exchange(send, receive):
        incoming = torch.empty_like(chunks[receive])
        operations = [dist.P2POp(isend, chunks[send].contiguous(), right),
                      dist.P2POp(dist.irecv, incoming, left)]
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        return incoming

    for step in range(world - 1):
        receive = (rank - step - 1) % world
        chunks[receive] += exchange((rank - step) % world, receive)
    for step in range(world - 1):
        receive = (rank - step) % world
        chunks[receive].copy_(exchange((rank - step + 1) % world, receive))


def reduce_scatter_turning_left(output, tensor):
    """The ring the other way round: each rank sends to its left neighbour."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = [chunk.clone() for chunk in tensor.chunk(world)]
    for step in range(world - 1):
        send, receive = (rank + step + 1) % world, (rank + step + 2) % world
        incoming = torch.empty_like(chunks[receive])
        request = dist.isend(chunks[send], left)
        dist.recv(incoming, right)
        request.wait()
        chunks[receive] += incoming
    output.copy_(chunks[rank])


def crossover_bytes_numpy(alpha, bandwidth, world):
    """Right, as a NumPy float32."""
    import numpy as np

    return np.float32(alpha * bandwidth * world)


REFERENCE = {"03.1": ring_all_reduce, "03.2": reduce_scatter, "03.3": crossover_bytes}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"03.1": [ring_all_reduce_batched], "03.2": [reduce_scatter_turning_left],
                "03.3": [crossover_bytes_numpy]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "03.1": [(ring_all_reduce_everyone_sends_first, "hang", "never comes"),
             (ring_all_reduce_without_all_gather, "fail", "values differ"),
             (ring_all_reduce_with_a_collective, "fail", "gloo:all_reduce"),
             (ring_all_reduce_that_raises, "error", "IndexError"),
             (ring_all_reduce_to_every_rank, "fail", "to ranks 1, 2; a ring sends at most 48")],
    "03.2": [(reduce_scatter_off_by_one, "fail", "values differ"),
             (reduce_scatter_from_every_rank, "fail", "to one neighbour only")],
    "03.3": [(crossover_bytes_without_world, "fail", "expected 1,506,500 bytes, got 753,250"),
             (crossover_bytes_nan, "fail", "got nan (not a finite number)")],
}
