"""Pipeline parallelism from send/recv: a model cut into pieces, each rank running its
piece (its *stage module*), micro-batches flowing through them, with a recorded timeline.

K is the number of ranks (``ranks``), v the virtual stages each rank holds
(``virtual_stages``), M the number of micro-batches (``micro_batches``). Chapter 06
builds its understanding on these pieces, one module per job:

* :mod:`.split`: :func:`split_sequential` cuts an ``nn.Sequential`` into stage modules;
  :func:`layer_costs` and :func:`balanced_cuts` measure each layer (parameters, FLOPs,
  activation size, time) and choose the cuts that balance them; :func:`micro_batch_size`
  and :func:`split_batch` cut a batch into micro-batches;
* :mod:`.schedules`: :func:`gpipe_step` runs one training step of this rank's stage
  module: all forward passes of the micro-batches, then all backward passes (GPipe's
  schedule), activations sent to the next rank and gradients to the previous one with
  non-blocking sends; :func:`interleaved_1f1b_step` runs one training step of 1F1B,
  interleaved when a rank holds several *virtual* stages (Narayanan et al., 2021);
  :func:`interleaved_order` is the order in which each rank runs its passes;
* :mod:`.p2p`: the messages between neighbouring ranks (a header announcing the
  activations' shape, the activations, their gradients) and :func:`message_tag`, which
  tells them apart where two ranks share several cuts;
* :mod:`.timeline`: :class:`Timeline` records when each rank computed what, for a Gantt
  chart (:func:`mgpu_helpers.viz.plots.plot_timeline`) and the measured idle share
  (:func:`bubble_fraction`, also with :func:`instant_transfers`), how long each pass
  started after its input existed (:func:`input_waits`), compared with the
  theory (:func:`theoretical_bubble`: (K-1)/(v·M+K-1) of the step, which is GPipe's
  (K-1)/(M+K-1) for v = 1; :func:`bubble_to_compute` gives the paper's form, the bubble
  over the ideal compute time, (K-1)/(v·M)).

With one micro-batch, :func:`gpipe_step` is the naive split: every rank waits for the
previous one, and K-1 of K ranks are idle at any time.
"""

from .p2p import MAX_DIMS, message_tag
from .schedules import gpipe_step, interleaved_1f1b_step, interleaved_order
from .split import (
    LayerCost,
    balanced_cuts,
    layer_costs,
    micro_batch_size,
    split_batch,
    split_sequential,
)
from .timeline import (
    Event,
    Timeline,
    bubble_fraction,
    bubble_to_compute,
    ideal_speedup,
    input_waits,
    instant_transfers,
    theoretical_bubble,
)

__all__ = [
    "MAX_DIMS", "Event", "LayerCost", "Timeline", "balanced_cuts", "bubble_fraction",
    "bubble_to_compute", "gpipe_step", "ideal_speedup", "input_waits", "instant_transfers",
    "interleaved_1f1b_step", "interleaved_order", "layer_costs", "message_tag",
    "micro_batch_size", "split_batch", "split_sequential", "theoretical_bubble",
]
