"""Model parallelism, one subpackage per way of dividing a model across ranks.

:mod:`~mgpu_helpers.parallel.pipeline` (chapter 06) cuts a model into pieces that run one
after the other on different ranks; :mod:`~mgpu_helpers.parallel.context` (chapter 12) cuts
the sequence, attention passing keys and values around a ring;
:mod:`~mgpu_helpers.parallel.expert` (chapter 13) spreads a mixture-of-experts layer's
experts over ranks; :mod:`~mgpu_helpers.parallel.tensor` (chapter 11, composed in chapter
14) splits each layer's weights. In each,
the algorithm (what is cut where, which rank computes what, in which order) lives apart
from its communication (what is sent to whom, and how messages are told apart), so that
a reader can follow one without the other.
"""
