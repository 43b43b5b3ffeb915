"""Chapter 03: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist
from torch.distributed import isend


def bidirectional_all_reduce(tensor):
    """Two rings at once: the first half of the tensor goes round to rank + 1, the second
    to rank - 1, one chunk of each per step (each ring's indices mirror the other's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))

    def step(s, add):
        # (chunks, chunk sent, chunk received, sent to, received from)
        rings = [(first, (rank - s) % world, (rank - s - 1) % world, right, left),
                 (second, (rank + s) % world, (rank + s + 1) % world, left, right)]
        requests = [dist.isend(chunks[send], to) for chunks, send, _, to, _ in rings]
        for chunks, _, receive, _, source in rings:  # received in the order sent
            incoming = torch.empty_like(chunks[receive])
            dist.recv(incoming, source)
            if add:
                chunks[receive] += incoming
            else:
                chunks[receive].copy_(incoming)
        for request in requests:
            request.wait()

    for s in range(world - 1):  # reduce-scatter on both rings
        step(s, add=True)
    for s in range(world - 1):  # all-gather: each ring one chunk further on
        step(s - 1, add=False)


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

def one_way_ring(half, sign):
    """Section 2's ring on ``half``, turning towards rank + sign (sign is 1 or -1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    to, source = (rank + sign) % world, (rank - sign) % world
    chunks = list(half.tensor_split(world))

    def exchange(s):
        send, receive = (rank - sign * s) % world, (rank - sign * (s + 1)) % world
        incoming = torch.empty_like(chunks[receive])
        request = dist.isend(chunks[send], to)
        dist.recv(incoming, source)
        request.wait()
        return chunks[receive], incoming

    for s in range(world - 1):
        chunk, incoming = exchange(s)
        chunk += incoming
    for s in range(-1, world - 2):
        chunk, incoming = exchange(s)
        chunk.copy_(incoming)


def two_one_way_rings_in_sequence(tensor):
    """Right sums and bytes, but one ring after the other: each link is used one way at
    a time."""
    first, second = tensor.tensor_split(2)
    one_way_ring(first, 1)
    one_way_ring(second, -1)


def rings_in_sequence_in_each_phase(tensor):
    """Both reduce-scatters, then both all-gathers, but in each phase one ring after the
    other: the rings take turns instead of advancing together."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))

    def exchange(chunks, send, receive, to, source, add):
        incoming = torch.empty_like(chunks[receive])
        request = dist.isend(chunks[send], to)
        dist.recv(incoming, source)
        request.wait()
        if add:
            chunks[receive] += incoming
        else:
            chunks[receive].copy_(incoming)

    for steps, add in ((range(world - 1), True), (range(-1, world - 2), False)):
        for s in steps:
            exchange(first, (rank - s) % world, (rank - s - 1) % world, right, left, add)
        for s in steps:
            exchange(second, (rank + s) % world, (rank + s + 1) % world, left, right, add)


def bidirectional_everyone_sends_first(tensor):
    """Blocking sends on every rank at once: each waits for a receive no one posts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))
    for s in range(world - 1):
        for chunks, send, receive, to, source in (
                (first, (rank - s) % world, (rank - s - 1) % world, (rank + 1) % world,
                 (rank - 1) % world),
                (second, (rank + s) % world, (rank + s + 1) % world, (rank - 1) % world,
                 (rank + 1) % world)):
            incoming = torch.empty_like(chunks[receive])
            dist.send(chunks[send], to)
            dist.recv(incoming, source)
            chunks[receive] += incoming


def bidirectional_without_all_gather(tensor):
    """Stops after the reduce-scatter: each rank holds only one chunk of each half's sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))
    for s in range(world - 1):
        rings = [(first, (rank - s) % world, (rank - s - 1) % world, right, left),
                 (second, (rank + s) % world, (rank + s + 1) % world, left, right)]
        requests = [dist.isend(chunks[send], to) for chunks, send, _, to, _ in rings]
        for chunks, _, receive, _, source in rings:
            incoming = torch.empty_like(chunks[receive])
            dist.recv(incoming, source)
            chunks[receive] += incoming
        for request in requests:
            request.wait()


def bidirectional_buffer_sized_from_the_sent_chunk(tensor):
    """The receive buffer made like the chunk this rank sends, not the one it receives:
    with uneven chunks a message lands in a buffer of another size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))
    for s in list(range(world - 1)) + list(range(-1, world - 2)):
        rings = [(first, (rank - s) % world, (rank - s - 1) % world, right, left),
                 (second, (rank + s) % world, (rank + s + 1) % world, left, right)]
        requests = [dist.isend(chunks[send], to) for chunks, send, _, to, _ in rings]
        for chunks, send, receive, _, source in rings:
            incoming = torch.empty_like(chunks[send])
            dist.recv(incoming, source)
            chunks[receive].copy_(incoming)  # never reached in agreement
        for request in requests:
            request.wait()


def bidirectional_with_a_collective(tensor):
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


def bidirectional_that_raises(tensor):
    """A mistake that raises inside the ranks: the chunk list indexed past its end."""
    world = dist.get_world_size()
    chunks = list(tensor.tensor_split(2)[0].tensor_split(world))
    chunks[world] += 1


def bidirectional_to_every_rank(tensor):
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


def section_2s_ring_pasted(tensor):
    """The chapter's one-way ring (section 2): right sums, but the link back stays idle."""
    from mgpu_helpers.labs.collectives import ring_all_reduce

    ring_all_reduce(tensor)


def bidirectional_receives_swapped(tensor):
    """Receives the second half's chunk first: on 2 ranks both come from one rank, and
    the first message to arrive is the first half's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))
    for s, add in [(s, True) for s in range(world - 1)] + [
            (s, False) for s in range(-1, world - 2)]:
        rings = [(first, (rank - s) % world, (rank - s - 1) % world, right, left),
                 (second, (rank + s) % world, (rank + s + 1) % world, left, right)]
        requests = [dist.isend(chunks[send], to) for chunks, send, _, to, _ in rings]
        for chunks, _, receive, _, source in reversed(rings):
            incoming = torch.empty_like(chunks[receive])
            dist.recv(incoming, source)
            if add:
                chunks[receive] += incoming
            else:
                chunks[receive].copy_(incoming)
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

def bidirectional_batched(tensor):
    """Each step's two sends and two receives as one batch of P2POps (built from the
    isend that the module imported, not dist.isend), empty chunks skipped: every rank
    splits alike, so a sender and its receiver skip the same ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))

    def step(s, add):
        rings = [(first, (rank - s) % world, (rank - s - 1) % world, right, left),
                 (second, (rank + s) % world, (rank + s + 1) % world, left, right)]
        operations, arrivals = [], []
        for chunks, send, receive, to, source in rings:
            if chunks[send].numel():
                operations.append(dist.P2POp(isend, chunks[send].contiguous(), to))
            if chunks[receive].numel():
                incoming = torch.empty_like(chunks[receive])
                operations.append(dist.P2POp(dist.irecv, incoming, source))
                arrivals.append((chunks[receive], incoming))
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()
        for chunk, incoming in arrivals:
            if add:
                chunk += incoming
            else:
                chunk.copy_(incoming)

    for s in range(world - 1):
        step(s, add=True)
    for s in range(world - 1):
        step(s - 1, add=False)


def bidirectional_blocking(tensor):
    """Blocking send and recv only, safe because in each ring's exchange half the ranks
    send first (the even ones) and the other half receive first; each step runs the
    first half's exchange, then the second's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = (list(half.tensor_split(world)) for half in tensor.tensor_split(2))

    def exchange(chunks, send, receive, to, source):
        incoming = torch.empty_like(chunks[receive])
        if rank % 2 == 0:
            dist.send(chunks[send], to)
            dist.recv(incoming, source)
        else:
            dist.recv(incoming, source)
            dist.send(chunks[send], to)
        return chunks[receive], incoming

    for s, add in [(s, True) for s in range(world - 1)] + [
            (s, False) for s in range(-1, world - 2)]:
        for chunk, incoming in (
                exchange(first, (rank - s) % world, (rank - s - 1) % world, right, left),
                exchange(second, (rank + s) % world, (rank + s + 1) % world, left, right)):
            if add:
                chunk += incoming
            else:
                chunk.copy_(incoming)


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


REFERENCE = {"03.1": bidirectional_all_reduce, "03.2": reduce_scatter,
             "03.3": crossover_bytes}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"03.1": [bidirectional_batched, bidirectional_blocking],
                "03.2": [reduce_scatter_turning_left], "03.3": [crossover_bytes_numpy]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "03.1": [(section_2s_ring_pasted, "fail",
              "all its data to rank 1 (40 bytes) and none to rank 2: the second half goes "
              "round the ring that turns the other way, to rank − 1"),
             (two_one_way_rings_in_sequence, "fail",
              "all 4 messages to rank 1 before the first to rank 2: the two rings must "
              "advance together"),
             (rings_in_sequence_in_each_phase, "fail",
              "had sent 2 messages to rank 1 and none to rank 2: the two rings must "
              "advance together"),
             (bidirectional_everyone_sends_first, "hang", "never comes"),
             (bidirectional_without_all_gather, "fail", "values differ"),
             (bidirectional_with_a_collective, "fail", "gloo:all_reduce"),
             (bidirectional_that_raises, "error", "IndexError"),
             (bidirectional_to_every_rank, "fail",
              "a message of 9 elements (36 bytes) to rank 1; a message holds one chunk of "
              "one half, at most 3 elements"),
             (bidirectional_buffer_sized_from_the_sent_chunk, "error",
              "the two ranks' chunk sizes disagree"),
             (bidirectional_receives_swapped, "error", "the two ranks' chunk sizes disagree")],
    "03.2": [(reduce_scatter_off_by_one, "fail", "values differ"),
             (reduce_scatter_from_every_rank, "fail", "to one neighbour only")],
    "03.3": [(crossover_bytes_without_world, "fail", "expected 1,506,500 bytes, got 753,250"),
             (crossover_bytes_nan, "fail", "got nan (not a finite number)")],

}
