"""Chapter 06: reference solutions and plausible mistakes (pipeline schedules)."""


def gpipe_order(stages, micro_batches):
    return [[("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
            for _ in range(stages)]


def one_f_one_b_order(stages, micro_batches):
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        order = [("F", m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            order += [("F", warmup + m), ("B", m)]
        order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
        schedule.append(order)
    return schedule


# Plausible mistakes -------------------------------------------------------------------

def gpipe_order_backward_reversed_on_the_first_stage(stages, micro_batches):
    """The first stage runs its backward passes last micro-batch first, while they reach
    it first micro-batch first: it waits."""
    schedule = gpipe_order(stages, micro_batches)
    schedule[0] = ([("F", m) for m in range(micro_batches)]
                   + [("B", m) for m in reversed(range(micro_batches))])
    return schedule


def gpipe_order_interleaved(stages, micro_batches):
    """Each micro-batch's backward right after its forward, on every stage: a stage waits
    for a backward that needs the next stage's, which waits for this stage's next forward."""
    return [[action for m in range(micro_batches) for action in (("F", m), ("B", m))]
            for _ in range(stages)]


def one_f_one_b_order_one_warmup_too_many(stages, micro_batches):
    """K - s warm-up forwards: the same length, but one micro-batch more held."""
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage, micro_batches)
        order = [("F", m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            order += [("F", warmup + m), ("B", m)]
        order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
        schedule.append(order)
    return schedule


def one_f_one_b_order_without_warmup(stages, micro_batches):
    """No warm-up on any stage."""
    return [[action for m in range(micro_batches) for action in (("F", m), ("B", m))]
            for _ in range(stages)]


def one_f_one_b_order_warmup_counted_from_the_wrong_end(stages, micro_batches):
    """Stage s warms up with s forwards instead of K - s - 1: the first stage waits for a
    backward while the last waits for a forward."""
    schedule = []
    for stage in range(stages):
        warmup = min(stage, micro_batches)
        order = [("F", m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            order += [("F", warmup + m), ("B", m)]
        order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
        schedule.append(order)
    return schedule


def one_f_one_b_order_warmup_not_capped(stages, micro_batches):
    """K - s - 1 warm-up forwards, even when there are fewer micro-batches than that."""
    schedule = []
    for stage in range(stages):
        warmup = stages - stage - 1
        order = [("F", m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            order += [("F", warmup + m), ("B", m)]
        order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
        schedule.append(order)
    return schedule


REFERENCE = {"06.1": gpipe_order, "06.2": one_f_one_b_order}
MISTAKES = {
    "06.1": [(gpipe_order_backward_reversed_on_the_first_stage, "fail", "2(M+K-1)"),
             (gpipe_order_interleaved, "fail", "2(M+K-1)"),
             (one_f_one_b_order, "fail", "GPipe runs every forward before any backward")],
    "06.2": [(one_f_one_b_order_one_warmup_too_many, "fail", "activations held at once"),
             (one_f_one_b_order_without_warmup, "fail", "2(M+K-1)"),
             (one_f_one_b_order_warmup_counted_from_the_wrong_end, "fail",
              "deadlock: stage 0 waits to run ('B', 0)"),
             (gpipe_order, "fail", "activations held at once"),
             (one_f_one_b_order_warmup_not_capped, "fail",
              "no stage can run more forward passes than there are micro-batches")],
}
