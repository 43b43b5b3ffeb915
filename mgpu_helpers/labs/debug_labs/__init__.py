"""Chapter 09's labs: distributed-training bugs reproduced on purpose, and their fixes.

Each ``lab_*`` function runs inside a rank (``launch(lab_..., nprocs=2, timeout=...)``).
With ``fixed=False`` it contains the bug and fails (or returns evidence of it) within the
launch's ``timeout`` (the group's: the labs that hang wait exactly that long, so a short
one makes them fail fast); with ``fixed=True`` it runs the corrected code. They are small
on purpose: the point is the symptom, the tool that finds the cause, and the fix.

One module per topic, every public name re-exported here (chapter 09 imports the package
as ``labs`` and calls ``labs.lab_...``):

* :mod:`.failures`: reading a failure: ``distributed_debug`` (``TORCH_DISTRIBUTED_DEBUG``
  for launched ranks) and ``failure_summary`` (a failed lab's report in one line, the
  same on every run and machine);
* :mod:`.hangs`: Lab 1, a collective only one rank calls, and ``monitored_barrier``;
* :mod:`.desync`: Lab 2, collectives with mismatched shapes or order;
* :mod:`.ddp_pitfalls`: Lab 3, a parameter without a gradient under DDP, and the cost
  of each fix;
* :mod:`.crash`: Lab 4, a rank killed mid-epoch, on the first attempt only;
* :mod:`.replicas`: Lab 5, rank-dependent initialisation under DDP and FSDP2, and
  ``replicas_agree``;
* :mod:`.augmentation`: Lab 5, identical augmentations on every rank (chapter 02's
  ``RandomAngles`` under a ``DistributedSampler``);
* :mod:`.flight_recorder`: the flight recorder's dumps, and one recorder per process.
"""

from .augmentation import TaggedAngles, lab_identical_augmentation
from .crash import rank_killed_at_epoch, train_digits_with_a_crash
from .ddp_pitfalls import DDPSteps, TwoHeads, lab_unused_parameter
from .desync import lab_mismatched_order, lab_mismatched_shapes
from .failures import LESSON_PHRASES, distributed_debug, failure_summary
from .flight_recorder import flight_records, lab_flight_recorder, lab_one_recorder_per_process
from .hangs import BUSY_SECONDS, lab_collective_on_one_rank, lab_monitored_barrier
from .replicas import lab_fsdp_rank_dependent_init, lab_rank_dependent_init, replicas_agree

__all__ = [
    "BUSY_SECONDS", "DDPSteps", "LESSON_PHRASES", "TaggedAngles", "TwoHeads",
    "distributed_debug", "failure_summary", "flight_records", "lab_collective_on_one_rank",
    "lab_flight_recorder", "lab_fsdp_rank_dependent_init", "lab_identical_augmentation",
    "lab_mismatched_order", "lab_mismatched_shapes", "lab_monitored_barrier",
    "lab_one_recorder_per_process", "lab_rank_dependent_init", "lab_unused_parameter",
    "rank_killed_at_epoch", "replicas_agree", "train_digits_with_a_crash",
]
