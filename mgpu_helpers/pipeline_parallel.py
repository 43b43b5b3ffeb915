"""Where chapter 06's pipeline helpers used to live: they moved to the package
:mod:`mgpu_helpers.parallel.pipeline` (splitting, schedules, point-to-point messages,
timelines, one module each), the Gantt chart to :func:`mgpu_helpers.viz.plot_timeline`
and :class:`~mgpu_helpers.memory.ActivationMeter` to :mod:`mgpu_helpers.memory`. This
module re-exports the old names so that code written against it keeps working; new code
imports from the new homes (``from mgpu_helpers.parallel import pipeline as pp``). Two
arguments were renamed on the way: a rank's module is ``stage_module`` (``stage_modules``
for the interleaved step), and K is ``ranks``, as ``Event.rank`` and ``Timeline(rank)``.
"""

from .memory import ActivationMeter
from .parallel.pipeline import (
    MAX_DIMS,
    Event,
    LayerCost,
    Timeline,
    balanced_cuts,
    bubble_fraction,
    bubble_to_compute,
    gpipe_step,
    ideal_speedup,
    instant_transfers,
    interleaved_1f1b_step,
    interleaved_order,
    layer_costs,
    micro_batch_size,
    split_sequential,
    theoretical_bubble,
)
from .viz import plot_timeline

__all__ = [
    "MAX_DIMS", "ActivationMeter", "Event", "LayerCost", "Timeline", "balanced_cuts",
    "bubble_fraction", "bubble_to_compute", "gpipe_step", "ideal_speedup",
    "instant_transfers", "interleaved_1f1b_step", "interleaved_order", "layer_costs",
    "micro_batch_size", "plot_timeline", "split_sequential", "theoretical_bubble",
]
