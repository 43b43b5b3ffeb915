"""Chapter 03: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist


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


def crossover_bytes(alpha, bandwidth, world):
    return alpha * bandwidth * world


def crossover_bytes_without_world(alpha, bandwidth, world):
    """Forgets that each rank sends only 2(N-1)/N of the tensor."""
    return alpha * bandwidth


REFERENCE = {"03.1": ring_all_reduce, "03.2": reduce_scatter, "03.3": crossover_bytes}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "03.1": [(ring_all_reduce_everyone_sends_first, "hang", "never comes"),
             (ring_all_reduce_without_all_gather, "fail", "values differ"),
             (ring_all_reduce_with_a_collective, "fail", "gloo:all_reduce"),
             (ring_all_reduce_that_raises, "error", "IndexError")],
    "03.2": [(reduce_scatter_off_by_one, "fail", "values differ")],
    "03.3": [(crossover_bytes_without_world, "fail", "expected 1,506,500 bytes, got 753,250")],
}
